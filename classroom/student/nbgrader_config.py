"""nbgrader settings of every student's server on the one-machine hub (``classroom/jupyterhub_config.py`` puts this
folder on ``JUPYTER_CONFIG_PATH`` and sets the variables read here)."""

import os

c = get_config()  # noqa: F821 (traitlets defines get_config when it loads this file)

c.Exchange.root = os.environ["KVLAB_EXCHANGE"]
c.CourseDirectory.course_id = os.environ["KVLAB_COURSE_ID"]
# nbgrader names a submission after the Unix user, and every student's server runs as the same one here; so name it
# after the hub user instead (a submission, and the feedback it gets back, then belong to alice or to bob).
c.CourseDirectory.student_id = os.environ["JUPYTERHUB_USER"]
