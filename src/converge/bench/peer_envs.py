"""The peers' virtual environments: one per peer under ``runs/peer-envs/<peer>``, made once, on first use.

Each holds torch (pinned, so nothing pulls another build), the peer, what loading a served model imports, and
converge itself (editable, ``--no-deps``): the peer then runs the very ``load_served_model(run).predict`` our
server runs. Separate environments because the peers pin what converge does not (MLServer ``fastapi<0.116``,
PyTriton ``numpy<2``), and Triton needs another interpreter:

- Triton (``nvidia-pytriton``, which ships ``tritonserver`` 2.51 and its Python backend): the backend's stub
  links the system ``libpython3.11``, so its environment is made from Debian's ``/usr/bin/python3.11``. One
  made from another 3.11 build loads a stdlib that does not match that library and fails at model load
  (``'_thread.RLock' object has no attribute '_recursion_count'``).
- MLServer: ``uvloop<0.22``. With uvloop 0.22 its parallel workers die with "There is no current event loop"
  (SeldonIO/MLServer#2286).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from ..data.atomic import atomic_write_bytes

PEERS = ("triton", "mlserver", "litserve")
SOURCE_ROOT = Path(__file__).resolve().parents[3]  # the converge checkout: src/converge/bench/peer_envs.py
DEFAULT_ENV_ROOT = SOURCE_ROOT / "runs" / "peer-envs"
# torch first and pinned: 2.13.0 is this machine's local CPU build; any other version would pull GBs of CUDA
TORCH_REQUIREMENT = "torch==2.13.0"
PEER_REQUIREMENTS = {"triton": ("nvidia-pytriton==0.7.0",), "mlserver": ("mlserver==1.7.1", "uvloop<0.22"),
                     "litserve": ("litserve==0.2.19",)}
PEER_DISTRIBUTIONS = {"triton": "nvidia-pytriton", "mlserver": "mlserver", "litserve": "litserve"}
SYSTEM_PYTHON = "/usr/bin/python3.11"  # Debian's, whose libpython3.11 the Triton Python-backend stub links
# what importing converge.serve.registry and loading a run of each built-in app import (converge: --no-deps)
MODEL_REQUIREMENTS = ("numpy>=1.26,<2.4", "scipy>=1.11,<1.17", "torchani>=2.9", "ase>=3.23", "fastapi>=0.115",
                      "httpx>=0.27", "orjson>=3.9", "prometheus-client>=0.20", "rich>=13")
READY_MARKER = ".converge-peer-env.json"


class PeerError(RuntimeError):
    """A peer environment or server that could not be set up, started or trusted; says why."""


def check_peer(peer: str) -> str:
    if peer not in PEERS:
        raise ValueError(f"peer {peer!r}: choose from {', '.join(PEERS)}")
    return peer


def peer_requirements(peer: str) -> tuple[str, ...]:
    """What goes into the peer's environment after torch: the peer and what our model loading imports."""
    return (*PEER_REQUIREMENTS[check_peer(peer)], *MODEL_REQUIREMENTS)


def base_python(peer: str) -> str:
    """The interpreter the peer's environment is made from: Debian's 3.11 for Triton, ours for the others."""
    return SYSTEM_PYTHON if check_peer(peer) == "triton" else os.path.realpath(sys.executable)


def wanted_env(peer: str) -> dict:
    """What a ready environment of ``peer`` must have been made with (kept in its marker file)."""
    return {"python": base_python(peer), "torch": TORCH_REQUIREMENT, "requirements": list(peer_requirements(peer)),
            "source": str(SOURCE_ROOT)}


def pip_check_problems(report: str) -> list[str]:
    """The lines of ``pip check`` that matter. Converge goes in with ``--no-deps``: its requirements that the
    served models never import (lalsuite, pycbc, pyscf, dask, ...) are missing on purpose and do not count."""
    lines = [line.strip() for line in report.splitlines() if line.strip()]
    return [line for line in lines if line != "No broken requirements found."
            and not (line.startswith("converge ") and line.endswith("which is not installed."))]


def run_checked(cmd: Sequence[str], log=lambda msg: None) -> str:
    """``cmd``'s standard output; a PeerError carrying the tail of its output when it fails."""
    log(" ".join(map(str, cmd)))
    done = subprocess.run(list(map(str, cmd)), capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerError(f"`{' '.join(map(str, cmd))}` failed ({done.returncode}):\n"
                        f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def _pip(python: Path, args: Sequence[str], log) -> None:
    run_checked([python, "-m", "pip", "install", "--disable-pip-version-check", *args], log)


def env_ready(peer: str, root: str | Path = DEFAULT_ENV_ROOT) -> bool:
    """Whether ``root/<peer>`` is a finished environment made as :func:`wanted_env` says (nothing is built)."""
    env = Path(root).resolve() / check_peer(peer)
    marker = env / READY_MARKER
    try:
        return (env / "bin" / "python").is_file() and json.loads(marker.read_text()).get("wanted") == wanted_env(peer)
    except (OSError, ValueError):
        return False


def ensure_peer_env(peer: str, root: str | Path = DEFAULT_ENV_ROOT, log=lambda msg: print(msg, file=sys.stderr)
                    ) -> Path:
    """The python of ``root/<peer>``, a virtual environment made here on first use from :func:`base_python`:
    torch (pinned, first), then the peer and the model's imports, then converge itself (editable,
    ``--no-deps``), then ``pip check``."""
    env = Path(root).resolve() / check_peer(peer)
    python = env / "bin" / "python"
    if env_ready(peer, root):
        return python
    base = base_python(peer)
    if not Path(base).is_file():
        raise PeerError(f"{peer}: its environment is made from Debian's {base} (the Triton Python-backend stub "
                        "links the system libpython3.11), which is missing: apt-get install python3.11 "
                        "python3.11-venv")
    log(f"{peer}: making its environment in {env} from {base} (once; minutes)")
    run_checked([base, "-m", "venv", "--clear", env], log)
    _pip(python, ["--upgrade", "pip"], log)
    _pip(python, [TORCH_REQUIREMENT], log)
    _pip(python, [TORCH_REQUIREMENT, *peer_requirements(peer)], log)  # torch repeated: nothing may move it
    _pip(python, ["--no-deps", "-e", str(SOURCE_ROOT)], log)
    report = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True).stdout
    if problems := pip_check_problems(report):
        raise PeerError(f"{peer}: `pip check` in {env} reports conflicts:\n" + "\n".join(problems))
    versions = run_checked([python, "-c", "import importlib.metadata as m, json, sys; print(json.dumps("
                            "{d: m.version(d) for d in sys.argv[1:]}))", PEER_DISTRIBUTIONS[peer], "torch",
                            "fastapi", "numpy", *(("uvloop",) if peer == "mlserver" else ())])
    atomic_write_bytes(env / READY_MARKER,
                       json.dumps({"wanted": wanted_env(peer), "versions": json.loads(versions)}, indent=2).encode())
    return python


def peer_versions(python: Path) -> dict[str, str]:
    """What :func:`ensure_peer_env` installed (the peer, torch, fastapi, numpy; uvloop for MLServer)."""
    return json.loads((python.parent.parent / READY_MARKER).read_text())["versions"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m converge.bench.peer_envs [PEER ...]``: make (or check) the peers' environments before a
    benchmark needs them (``make peers``)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("peers", nargs="*", default=list(PEERS), help=f"of {', '.join(PEERS)} (default: all)")
    parser.add_argument("--root", default=str(DEFAULT_ENV_ROOT), help="where the environments live")
    args = parser.parse_args(argv)
    failed = []
    for peer in args.peers:
        try:
            check_peer(peer)
            ensure_peer_env(peer, args.root)
            print(f"{peer}: ready in {Path(args.root) / peer}")
        except (ValueError, RuntimeError, OSError) as err:
            print(f"{peer}: {err}", file=sys.stderr)
            failed.append(peer)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
