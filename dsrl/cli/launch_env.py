"""Multi-node launch helpers: ``.deepspeed_env`` files, hostfile validation, a preflight over pdsh.

DeepSpeed's multi-node runner (``deepspeed --hostfile H``, pdsh by default) forwards only
variables whose names start with ``PYTHON``, ``MLFLOW``, ``MV2`` or ``UCX`` (plus the accelerator's
own, e.g. ``NCCL`` on CUDA, none on CPU) to the other nodes. Everything else a rank needs, such as
``DS_ACCELERATOR``, ``OMP_NUM_THREADS`` or dsrl's ``DSRL_*`` settings, must be listed in a
``.deepspeed_env`` file in the launch directory or in ``~`` (the launch directory wins; the
name can be changed with ``DS_ENV_FILE``). The runner reads that file naively: every line is split
on the first ``=``, so a blank line or a ``#`` comment crashes it with ``ValueError: not enough
values to unpack``, surrounding whitespace is stripped, and a value with shell-special characters is
wrapped in double quotes and then evaluated by the remote shell. :func:`write_deepspeed_env`
writes only lines that survive that trip unchanged and refuses anything else; for the launchers without a
remote shell (``--launcher slurm``, ``openmpi``: ``srun --export``, ``mpirun -x``) it also refuses a value the
runner would quote (the quotes arrive) and, for Slurm, a comma (``--export`` cuts there).

Command line::

    python -m dsrl.cli.launch_env write [--out .deepspeed_env] [--set KEY=VALUE ...] [--no-defaults] [--launcher L]
    python -m dsrl.cli.launch_env check-hostfile HOSTFILE
    python -m dsrl.cli.launch_env check-env [FILE] [--launcher slurm|openmpi]
    python -m dsrl.cli.launch_env check-hosts HOSTFILE [--ssh_port N] [--connect_timeout S]

``check-hosts`` is a preflight for the gap the runner leaves: it only pre-checks ssh to the *first*
host, so an unreachable later host shows up as an ssh error from pdsh while the ranks that did
start wait for the missing ones until the rendezvous timeout (``DEEPSPEED_TIMEOUT`` minutes,
default 10). The preflight goes through pdsh over ssh with the runner's exports and working
directory and imports dsrl and deepspeed with this Python on every host, in parallel, within the
connect timeout. (Inside the job, every launcher's ranks also check in with rank 0 before any work:
:mod:`dsrl.core.rendezvous`.)
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

#: Name prefixes the DeepSpeed 0.19.8 runner exports to remote nodes by itself (``EXPORT_ENVS``);
#: the CUDA accelerator adds ``NCCL``, the CPU accelerator nothing.
RUNNER_EXPORTED_PREFIXES: tuple[str, ...] = ("MLFLOW", "PYTHON", "MV2", "UCX")
#: dsrl's own settings: every variable with this prefix is forwarded by :func:`collect_env`.
DSRL_PREFIX = "DSRL_"
#: Variables that change what a rank computes or how it starts; forwarded when set locally.
DEFAULT_FORWARD: tuple[str, ...] = (
    "DS_ACCELERATOR",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "CUBLAS_WORKSPACE_CONFIG",
    "DEEPSPEED_TIMEOUT",
    "TORCH_EXTENSIONS_DIR",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)
DEFAULT_FILE_NAME = ".deepspeed_env"

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Characters the runner would put inside double quotes that the remote shell still interprets
# (or that end the line): such a value would not arrive unchanged.
_UNSAFE_VALUE_RE = re.compile(r'[\n\r\x00"$`\\]')
_HOST_LINE_RE = re.compile(r"^(\S+)\s+slots=(\d+)")


class LaunchEnvError(ValueError):
    """A ``.deepspeed_env`` entry or a hostfile that DeepSpeed's runner would mishandle."""


def runner_forwards(name: str) -> bool:
    """Whether DeepSpeed's runner forwards ``name`` to remote nodes without ``.deepspeed_env``."""
    return name.startswith(RUNNER_EXPORTED_PREFIXES)


def validate_entry(key: str, value: str) -> None:
    """Raise :class:`LaunchEnvError` unless ``KEY=VALUE`` reaches the remote rank unchanged."""
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise LaunchEnvError(f"invalid environment variable name {key!r} for .deepspeed_env")
    if not isinstance(value, str):
        raise LaunchEnvError(f"{key}: value must be a string, got {type(value).__name__}")
    if _UNSAFE_VALUE_RE.search(value):
        raise LaunchEnvError(f"{key}: value {value!r} contains a newline, NUL, quote, '$', '`' or backslash; "
                             "DeepSpeed's runner cannot forward it unchanged through .deepspeed_env")
    if value != value.strip():
        raise LaunchEnvError(f"{key}: value {value!r} has surrounding whitespace, which the runner strips")


#: The characters DeepSpeed's runner leaves unquoted (``MultiNodeRunner.add_export``); any other makes it wrap the
#: value in double quotes, which pdsh's remote shell removes but ``srun --export`` and ``mpirun -x`` keep.
_RUNNER_PLAIN_RE = re.compile(r"^[\w@%+=:,./-]*$")
#: Launchers that take the exports without a shell: what reaches their ranks is the value as the runner wrote it.
SHELL_FREE_LAUNCHERS = ("slurm", "openmpi", "mpich", "impi", "mvapich")


def check_for_launcher(key: str, value: str, launcher: str) -> None:
    """Raise :class:`LaunchEnvError` unless ``KEY=VALUE`` reaches the ranks of ``deepspeed --launcher LAUNCHER``
    unchanged: without a remote shell (Slurm, MPI) a value the runner quotes arrives with the quotes, and ``srun
    --export`` splits its list at commas, so such a value arrives cut."""
    if launcher not in SHELL_FREE_LAUNCHERS:
        return
    if not _RUNNER_PLAIN_RE.match(value):
        instead = ("Set it in the job's environment instead (srun --export=ALL passes it on)" if launcher == "slurm"
                   else f"Export it in the launching shell and pass --launcher_args '-x {key}' (mpirun forwards its "
                        "own value)")
        raise LaunchEnvError(f"{key}: value {value!r} holds a character outside letters, digits and _@%+=:,./-, which "
                             f"DeepSpeed's runner wraps in double quotes; --launcher {launcher} passes them on "
                             f"literally (no shell removes them). {instead}")
    if launcher == "slurm" and "," in value:
        raise LaunchEnvError(f"{key}: value {value!r} holds a comma, where `srun --export=ALL,K=V,...` cuts it; under "
                             "Slurm the job's environment reaches every rank anyway (--export=ALL): set it there")


def format_deepspeed_env(values: Mapping[str, str]) -> str:
    """The file text: one ``KEY=VALUE`` line per entry, no blank or comment line, final newline."""
    lines = []
    for key, value in values.items():
        validate_entry(key, value)
        lines.append(f"{key}={value}\n")
    return "".join(lines)


def parse_deepspeed_env(text: str, source: str = DEFAULT_FILE_NAME) -> dict[str, str]:
    """Parse ``.deepspeed_env`` text as the runner does, but reject what would crash or mangle it."""
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        content = line.rstrip("\n")
        if not content.strip() or content.lstrip().startswith("#") or "=" not in content:
            raise LaunchEnvError(f"{source}:{lineno}: {content!r} is not KEY=VALUE; DeepSpeed's runner crashes on "
                                 "blank, comment and malformed lines")
        key, value = content.split("=", 1)
        validate_entry(key, value)
        out[key] = value
    return out


def collect_env(environ: Mapping[str, str] | None = None, names: Iterable[str] = DEFAULT_FORWARD,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to forward: ``names`` and every ``DSRL_*`` variable that are set in
    ``environ`` (default ``os.environ``), then ``extra`` on top. Names the runner forwards by itself
    are left out."""
    environ = os.environ if environ is None else environ
    wanted = list(names) + sorted(k for k in environ if k.startswith(DSRL_PREFIX))
    out = {k: environ[k] for k in wanted if k in environ and not runner_forwards(k)}
    out.update(extra or {})
    return out


def write_deepspeed_env(path: str | os.PathLike[str], values: Mapping[str, str], merge: bool = False,
                        launcher: str = "pdsh") -> Path:
    """Write ``values`` to ``path`` (a file, or a directory to hold ``.deepspeed_env``) atomically.

    With ``merge`` the entries of an existing file are kept unless ``values`` overrides them; an
    existing file that the runner would choke on is an error rather than silently rewritten. ``launcher``
    (``deepspeed --launcher``) refuses what that launcher would not pass on unchanged (:func:`check_for_launcher`).
    Returns the file written.
    """
    target = Path(path)
    if target.is_dir():
        target = target / os.environ.get("DS_ENV_FILE", DEFAULT_FILE_NAME)
    merged: dict[str, str] = {}
    if merge and target.exists():
        merged.update(parse_deepspeed_env(target.read_text(encoding="utf-8"), str(target)))
    merged.update(values)
    for key, value in merged.items():
        check_for_launcher(key, value, launcher)
    text = format_deepspeed_env(merged)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """``{host: slots}`` from hostfile text, validated more strictly than DeepSpeed does.

    Accepted lines are ``HOST slots=N``, blank lines and ``#`` comments, as in DeepSpeed. Refused
    with the line number: any other line and a repeated host (DeepSpeed refuses those too, without
    the line number), ``slots=0`` (DeepSpeed accepts it), and ``localhost`` next to other hosts
    (each node would resolve it to itself).
    """
    hosts: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = _HOST_LINE_RE.match(stripped)
        if not match:
            raise LaunchEnvError(f"{source}:{lineno}: {stripped!r} is not 'HOST slots=N'")
        host, slots = match.group(1), int(match.group(2))
        if host in hosts:
            raise LaunchEnvError(f"{source}:{lineno}: host {host!r} is listed twice")
        if slots < 1:
            raise LaunchEnvError(f"{source}:{lineno}: host {host!r} has slots={slots}; need at least 1")
        hosts[host] = slots
    if not hosts:
        raise LaunchEnvError(f"{source}: no 'HOST slots=N' line (without a hostfile DeepSpeed runs on localhost)")
    if len(hosts) > 1 and "localhost" in hosts:
        raise LaunchEnvError(f"{source}: 'localhost' next to other hosts; use a name or address every node can reach")
    return hosts


def validate_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """:func:`parse_hostfile` on a file."""
    return parse_hostfile(Path(path).read_text(encoding="utf-8"), str(path))


def global_ranks(hosts: Mapping[str, int]) -> dict[str, list[int]]:
    """Global ranks per host as DeepSpeed assigns them: hostfile order, slot order within a host."""
    out, rank = {}, 0
    for host, slots in hosts.items():
        out[host] = list(range(rank, rank + slots))
        rank += slots
    return out


def runner_exports(cwd: str | os.PathLike[str] | None = None,
                   environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What DeepSpeed's runner exports to every remote command when launched from ``cwd``: the
    forwarded-prefix variables, ``PYTHONPATH`` with ``cwd`` in front, then ``~/.deepspeed_env`` and
    ``./.deepspeed_env`` (later files win). Raises :class:`LaunchEnvError` on a file the runner
    would crash on."""
    environ = os.environ if environ is None else environ
    cwd = os.path.abspath(cwd or ".")
    out = {k: v for k, v in environ.items() if runner_forwards(k)}
    out["PYTHONPATH"] = f"{cwd}:{environ['PYTHONPATH']}" if environ.get("PYTHONPATH") else cwd
    name = environ.get("DS_ENV_FILE", DEFAULT_FILE_NAME)
    for folder in (os.path.expanduser("~"), cwd):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                out.update(parse_deepspeed_env(f.read(), path))
    return out


PREFLIGHT_OK = "DSRL_PREFLIGHT_OK"


def check_hosts(hosts: Sequence[str], cwd: str | os.PathLike[str] | None = None, python: str = sys.executable,
                connect_timeout: int = 5, command_timeout: int = 120, ssh_port: int | None = None,
                environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Reach every host the way the pdsh runner will and import dsrl and deepspeed there.

    Returns ``{host: what went wrong}`` for the hosts that failed; empty when all are fine.
    """
    if not hosts:
        return {}
    pdsh = shutil.which("pdsh")
    if pdsh is None:
        return dict.fromkeys(hosts, "pdsh is not installed on the launching node")
    env = dict(os.environ if environ is None else environ)
    env["PDSH_RCMD_TYPE"] = "ssh"
    if ssh_port is not None:
        env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}".strip()
    cwd = os.path.abspath(cwd or ".")
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in runner_exports(cwd, env).items())
    probe = f"import dsrl, deepspeed; print('{PREFLIGHT_OK}', flush=True)"
    remote = f"{exports}cd {shlex.quote(cwd)} && {shlex.quote(python)} -c {shlex.quote(probe)}"
    cmd = [pdsh, "-S", "-t", str(connect_timeout), "-u", str(command_timeout), "-w", ",".join(hosts), remote]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=connect_timeout + command_timeout + 30)
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        output = f"{err.stdout or ''}{err.stderr or ''}"
        output = output if isinstance(output, str) else output.decode(errors="replace")
    lines = output.splitlines()
    problems = {}
    for host in hosts:
        if f"{host}: {PREFLIGHT_OK}" in lines:
            continue
        mine = [ln for ln in lines if ln.startswith(f"{host}: ") or f": {host}: " in ln]
        problems[host] = " | ".join(ln.strip() for ln in mine[-4:]) or "no answer"
    return problems


def _parse_set(items: Iterable[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise LaunchEnvError(f"--set {item!r}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsrl.cli.launch_env", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a .deepspeed_env that DeepSpeed's runner can read")
    w.add_argument("--out", default=DEFAULT_FILE_NAME, help="file, or directory to hold .deepspeed_env")
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an entry to add (repeatable)")
    w.add_argument("--forward", action="append", default=[], metavar="NAME",
                   help="also forward this variable from the current environment (repeatable)")
    w.add_argument("--no-defaults", action="store_true",
                   help=f"do not forward {', '.join(DEFAULT_FORWARD)} and {DSRL_PREFIX}* from the environment")
    w.add_argument("--merge", action="store_true", help="keep the entries of an existing file")
    w.add_argument("--launcher", default="pdsh", help="the deepspeed --launcher the file is for (default pdsh)")
    h = sub.add_parser("check-hostfile", help="validate a hostfile and print the rank layout")
    h.add_argument("hostfile")
    e = sub.add_parser("check-env", help="validate an existing .deepspeed_env")
    e.add_argument("file", nargs="?", default=DEFAULT_FILE_NAME)
    e.add_argument("--launcher", default="pdsh", help="the deepspeed --launcher the file is for (default pdsh)")
    c = sub.add_parser("check-hosts", help="reach every hostfile host through pdsh/ssh and import dsrl there")
    c.add_argument("hostfile")
    c.add_argument("--ssh_port", type=int, default=None, help="as deepspeed's --ssh_port")
    c.add_argument("--connect_timeout", type=int, default=5, help="seconds to wait for each ssh connection")
    c.add_argument("--command_timeout", type=int, default=120, help="seconds allowed for the remote import")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "write":
            names = (() if args.no_defaults else DEFAULT_FORWARD) + tuple(args.forward)
            environ = os.environ if not args.no_defaults else {k: v for k, v in os.environ.items()
                                                               if k in args.forward}
            values = collect_env(environ, names, _parse_set(args.set))
            path = write_deepspeed_env(args.out, values, merge=args.merge, launcher=args.launcher)
            print(f"wrote {len(values)} entries to {path}")
        elif args.cmd == "check-hostfile":
            hosts = validate_hostfile(args.hostfile)
            for host, ranks in global_ranks(hosts).items():
                print(f"{host}: slots={hosts[host]} global ranks {ranks[0]}..{ranks[-1]}")
            print(f"world size {sum(hosts.values())} on {len(hosts)} nodes")
        elif args.cmd == "check-env":
            values = parse_deepspeed_env(Path(args.file).read_text(encoding="utf-8"), args.file)
            for key, value in values.items():
                check_for_launcher(key, value, args.launcher)
            print(f"{args.file}: {len(values)} valid entries")
        else:
            hosts = list(validate_hostfile(args.hostfile))
            problems = check_hosts(hosts, connect_timeout=args.connect_timeout,
                                   command_timeout=args.command_timeout, ssh_port=args.ssh_port)
            for host, why in problems.items():
                print(f"error: host {host} is not usable: {why}", file=sys.stderr)
            if problems:
                print(f"error: {len(problems)} of {len(hosts)} hosts failed the preflight", file=sys.stderr)
                return 1
            print(f"all {len(hosts)} hosts reachable and able to import dsrl: {', '.join(hosts)}")
    except (LaunchEnvError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
