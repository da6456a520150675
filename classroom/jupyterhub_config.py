"""A JupyterHub for a class on ONE machine: students log in, fetch lessons, validate and submit them through
nbgrader's exchange; the instructor releases, collects and grades from the command line (``python -m autograde``).

Start it with the interpreter the course is installed in (no environment needs to be active)::

    .venv/bin/python -m jupyterhub -f classroom/jupyterhub_config.py

NOT FOR REAL ACCOUNTS. Every student's server runs as the Unix user who started the hub
(``SimpleLocalProcessSpawner``), so students can read one another's files, and on loopback anyone may log in
under any name (the dummy authenticator). That suits a trial run, a workshop on a trusted network, or a test.
README.md ("Running a class") says what to use for graded coursework.

Settings, each an environment variable read when the hub starts:

- ``KVLAB_HUB_IP``: the address students connect to (default 127.0.0.1, this machine only). An address reachable
  from a network, such as ``0.0.0.0``, also needs ``KVLAB_HUB_PASSWORD``: one shared password for every login.
- ``KVLAB_HUB_PORT``: that address's port (default 8000).
- ``KVLAB_HUB_STATE``: where the hub keeps its database, cookie secret and the students' home folders
  (default ``classroom/state``).
- ``KVLAB_EXCHANGE``: nbgrader's exchange folder, shared with the instructor's commands
  (default ``classroom/state/exchange``).

Every other port (the hub itself, 8081; the proxy's API, 8001) stays on 127.0.0.1 whatever ``KVLAB_HUB_IP`` says,
and JupyterHub's own flags (``--port``, ``--JupyterHub.hub_port``, ...) override what this file sets.
"""

import ipaddress
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from traitlets.config.loader import PyFileConfigLoader

c = get_config()  # noqa: F821 (traitlets defines get_config when it loads this file)

HERE = Path(__file__).resolve().parent
STATE = Path(os.environ.get("KVLAB_HUB_STATE") or HERE / "state").resolve()
EXCHANGE = Path(os.environ.get("KVLAB_EXCHANGE") or STATE / "exchange").resolve()
IP = os.environ.get("KVLAB_HUB_IP") or "127.0.0.1"
PORT = os.environ.get("KVLAB_HUB_PORT") or "8000"
try:
    LOOPBACK = ipaddress.ip_address(IP).is_loopback
except ValueError:
    sys.exit(f"KVLAB_HUB_IP={IP!r} is not an IP address; for example 127.0.0.1 (this machine only) or 0.0.0.0 (all)")
if not PORT.isdigit() or not 0 < int(PORT) < 65536:
    sys.exit(f"KVLAB_HUB_PORT={PORT!r} is not a port number (1-65535)")
# The interpreter running the hub is the course's; its console scripts (the proxy, jupyter) sit beside it, and an
# environment nobody activated is not on PATH.
SCRIPTS = sysconfig.get_path("scripts")
# The course id the instructor's commands use, so the students' servers look for lessons under the same one.
COURSE_ID = PyFileConfigLoader("nbgrader_config.py", path=str(HERE.parent / "autograde")).load_config()[
    "CourseDirectory"
]["course_id"]

STATE.mkdir(parents=True, exist_ok=True)

c.JupyterHub.ip = IP
c.JupyterHub.port = int(PORT)
c.JupyterHub.hub_ip = "127.0.0.1"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:8001"
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
# PyPI's configurable-http-proxy (pure Python, installed with the course) beside this interpreter, else npm's on PATH.
# PyPI's reads a whole response before it passes it on, so a stream (the progress bar of a starting server) reaches
# the browser only when it ends; without a longer limit than its default 20 s it would be cut before a slow server
# is up, and the student would wait on that page forever.
proxy = shutil.which("configurable-http-proxy", path=os.pathsep.join([SCRIPTS, os.environ.get("PATH", "")]))
if proxy:
    c.ConfigurableHTTPProxy.command = [proxy, "--proxy-timeout", str(600_000)]  # milliseconds

if LOOPBACK:
    c.JupyterHub.authenticator_class = "dummy"  # any name, any password: only people on this machine can reach it
else:
    password = os.environ.get("KVLAB_HUB_PASSWORD", "")
    if len(password) < 8:
        sys.exit(
            f"KVLAB_HUB_IP={IP} opens the hub to a network: set KVLAB_HUB_PASSWORD to a shared password of at least "
            "8 characters (students then log in with any name and that password)"
        )
    c.JupyterHub.authenticator_class = "shared-password"
    c.SharedPasswordAuthenticator.user_password = password
c.Authenticator.allow_all = True

c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = str(STATE / "home" / "{username}")
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.ip = "127.0.0.1"
c.Spawner.default_url = "/lab"
# A student's own ~/.jupyter could turn the instructor panels back on; ignore it.
c.Spawner.disable_user_config = True
# A server's first start imports JupyterLab and nbgrader: a minute or more on a busy 2-core machine.
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 180
# Jupyter refuses to run as root unless told to; a hub started by root runs every student's server as root.
c.Spawner.args = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
c.Spawner.environment = {
    # classroom/student holds the students' nbgrader settings and which nbgrader extensions their servers load.
    "JUPYTER_CONFIG_PATH": str(HERE / "student"),
    "KVLAB_EXCHANGE": str(EXCHANGE),
    "KVLAB_COURSE_ID": COURSE_ID,
    # Terminals and kernels find this environment's python, jupyter and kvlab.
    "PATH": os.pathsep.join([SCRIPTS, os.environ.get("PATH") or os.defpath]),
}
