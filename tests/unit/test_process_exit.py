"""dsrl.runtime.process_exit.leave: how every distributed entry point ends (no interpreter finalization while
gloo's worker threads may still release collective work: docs/reliability.md, "Exit")."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Scripts that run as ranks of a gloo job (the DeepSpeed launcher's children); megatron_common/megatron_cp and
# device_traffic are modules. The spawned bench ranks end through bench/_common.end_rank.
ENTRY_POINTS = ["launch/train.py", "launch/train_megatron.py", "dsrl/check.py", "dsrl/cli/check.py",
                *sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "workers").glob("*.py")
                        if p.name not in ("megatron_common.py", "megatron_cp.py", "device_traffic.py")),
                "bench/overhead.py", "bench/throughput.py", "bench/checkpoint_costs.py", "dsrl/cli/check_megatron.py"]


def _main_block_calls_leave(source: str) -> bool:
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return any(isinstance(n, ast.Call) and ast.unparse(n.func).endswith("leave") for n in ast.walk(node))
    return False


def test_leave_runs_cleanups_flushes_logging_and_exits_with_the_code(tmp_path):
    log = tmp_path / "log.txt"
    script = textwrap.dedent(f"""
        import logging, sys
        from dsrl.runtime.process_exit import leave
        handler = logging.FileHandler({str(log)!r})
        logging.getLogger("t").addHandler(handler)
        logging.getLogger("t").warning("last line")
        sys.stdout.write("unflushed")
        leave(7, [lambda: print("cleanup ran", end=" ")])
        print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "unflushedcleanup ran " and log.read_text() == "last line\n"


@pytest.mark.parametrize("path", ENTRY_POINTS)
def test_distributed_entry_points_end_through_leave(path):
    assert _main_block_calls_leave((REPO / path).read_text()), \
        f"{path}: end the __main__ block with dsrl.runtime.process_exit.leave(...) (gloo exit race)"


def test_the_entry_point_check_sees_a_plain_exit():
    planted = 'import sys\n\ndef main():\n    return 0\n\nif __name__ == "__main__":\n    sys.exit(main())\n'
    assert not _main_block_calls_leave(planted)
    assert _main_block_calls_leave(planted.replace("sys.exit(main())", "leave(main())"))
