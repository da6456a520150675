"""Set kvlab up on a fresh machine, then open the course or run the tests. Standard library only.

    python3 bootstrap.py course   # install everything, open JupyterLab on lessons/ (headless: run `kvlab bench`)
    python3 bootstrap.py test     # install everything, run the linter and every test

(``py bootstrap.py ...`` on Windows.) No environment needs to be active, and nothing needs to be on PATH but
Python itself: the course's own commands find the tools they start (nbgrader's alembic, Jupyter kernels) next to
the interpreter that runs them.

Where it installs: into the active virtual environment or conda environment if there is one, else into a
``.venv`` folder it creates here (system Pythons often refuse ``pip install``).

Which PyTorch: an installed torch is kept, whatever its build. Otherwise, on a machine with an NVIDIA driver
(``nvidia-smi`` present) the default package index's build, which carries CUDA on Linux; on any other machine
the CPU build from PyTorch's CPU index, so a laptop does not download gigabytes of CUDA libraries. Override the
version with the environment variable ``KVLAB_TORCH`` (for example ``KVLAB_TORCH="torch==2.15.0"``).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The release the course's measurements were taken with; any torch >= 2.4 runs kvlab.
TORCH = os.environ.get("KVLAB_TORCH", "torch==2.13.0")


def in_environment() -> bool:
    return sys.prefix != sys.base_prefix or bool(os.environ.get("CONDA_PREFIX"))


def python_to_use() -> str:
    """The interpreter to install into: the active environment's, or ./.venv's (created on first use)."""
    if in_environment():
        return sys.executable
    env = ROOT / ".venv"
    exe = env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if not exe.exists():
        print(f"creating a virtual environment in {env}")
        try:
            venv.create(env, with_pip=True)
        except Exception as e:  # Debian/Ubuntu ship venv's pip support separately
            sys.exit(f"could not create {env} ({e}). Install python3-venv, or activate an environment and rerun.")
    return str(exe)


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, cwd=ROOT, env=env)
    if result.returncode:
        sys.exit(result.returncode)


def has_torch(python: str) -> bool:
    return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0


def install(python: str, extras: str) -> None:
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    if not has_torch(python):
        if shutil.which("nvidia-smi") or platform.system() == "Darwin":
            run([*pip, TORCH])  # CUDA build on Linux; the only build on macOS
        else:
            # The CPU index outranks the default one (2.x.y+cpu sorts above 2.x.y); where it cannot be reached
            # pip warns and carries on with the indexes it has.
            run([*pip, "--extra-index-url", TORCH_CPU_INDEX, TORCH])
    run([*pip, "-e", f".[{extras}]"])


def course(python: str) -> None:
    headless = platform.system() == "Linux" and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    if headless:
        print(
            "No display found: running the headless demo. For the notebooks on a remote machine, run\n"
            f"  {python} -m jupyterlab --no-browser lessons/\nand open the printed URL through an SSH tunnel."
        )
        run([python, "-m", "kvlab.cli", "bench"])
    else:
        # JupyterLab's terminals should find `kvlab` and `python` of this environment, activated or not.
        env = dict(os.environ, PATH=os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")]))
        run([python, "-m", "jupyterlab", "lessons/"], env=env)


def test(python: str) -> None:
    run([python, "-m", "ruff", "check", "."])
    # One worker per CPU (pytest-xdist), each taking whole test files in the order tests/conftest.py sets, longest
    # first; then the tests that time real seconds, alone, so that no other worker's load shifts what they measure.
    pytest = [python, "-m", "pytest", "-q"]
    run([*pytest, "-n", "logical", "--dist", "loadfile", "--no-loadscope-reorder", "-m", "not serial"])
    run([*pytest, "-m", "serial"])


def main() -> None:
    commands = {"course": course, "test": test}
    # The tests also get kvlab[gpu] (Triton, about 1 GB), whose kernels they run in Triton's CPU interpreter,
    # kvlab[classroom] (JupyterHub and its proxy), which the classroom tests start on loopback, kvlab[onnx]
    # (ONNX Runtime), which runtime="onnx" and the flat-step benchmark's tests run, kvlab[numba], which
    # runtime="numba" compiles with, and kvlab[openvino], the flat step's third instrument.
    extras = {"course": "course,dev", "test": "course,dev,gpu,classroom,onnx,numba,openvino"}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit(f"usage: python3 bootstrap.py {{{','.join(commands)}}}")
    if sys.version_info < (3, 10):  # noqa: UP036 -- this file runs before anything checks the version
        sys.exit(f"kvlab needs Python 3.10 or newer; this is {platform.python_version()}")
    python = python_to_use()
    install(python, extras[sys.argv[1]])
    commands[sys.argv[1]](python)


if __name__ == "__main__":
    main()
