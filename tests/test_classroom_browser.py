"""A student on the shipped one-machine hub, in a real headless browser: log in, fetch the lesson from the
Assignments panel, open it in JupyterLab, run its first code cell and see the output; the instructor's nbgrader
panels (formgrader, course list, create assignment) are not there, nor the formgrader's server extension.

Needs a system Chromium (Debian: ``apt-get install -y chromium``), driven by ``playwright`` (the dev extra) through
``executable_path``, and JupyterHub with a proxy (the classroom extra). Skipped where one is missing, except under
CI (``CI`` set, as ``.ci/run`` sets it), where that fails.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.classroom import FIRST_CELL_OUTPUT, LESSON, SPAWN_S, Hub, course_with_lesson, need_hub

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.classroom,
    pytest.mark.skipif(
        CHROMIUM is None and not os.environ.get("CI"),
        reason="no chromium on PATH (Debian: apt-get install -y chromium)",
    ),
]
# The commands of nbgrader's instructor panels, which its Nbgrader menu lists wherever their plugins run.
INSTRUCTOR_COMMANDS = {"nbgrader:open-formgrader", "nbgrader:open-course-list", "nbgrader:open-create-assignment"}
MENU_ITEMS = "els => els.map(e => [e.dataset.command, e.classList.contains('lm-mod-hidden')])"
STEP_MS = 120_000  # one click's effect (a fetch, a kernel's start) on a busy 2-core machine


def test_a_student_opens_the_fetched_lesson_and_runs_it(tmp_path: Path) -> None:
    need_hub()
    if CHROMIUM is None:
        pytest.fail("CI has no chromium on PATH; install it: apt-get install -y chromium", pytrace=False)
    exchange = tmp_path / "exchange"
    course_with_lesson(tmp_path / "course", exchange)

    with Hub(tmp_path, exchange) as hub, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-proxy-server"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(STEP_MS)
        try:
            page.goto(f"{hub.url}/hub/login")
            page.fill("#username_input", "alice")
            page.fill("#password_input", "any")  # the dummy authenticator takes any password
            page.click("#login_submit")
            page.wait_for_selector(".jp-LabShell", timeout=SPAWN_S * 1000)
            hub.record()

            # The learner's panel is in the Nbgrader menu; the instructor's are hidden there, their plugins off.
            page.click(".lm-MenuBar-itemLabel:text-is('Nbgrader')")
            items = page.eval_on_selector_all(".lm-Menu-item[data-command^='nbgrader:']", MENU_ITEMS)
            assert {command for command, _ in items} >= INSTRUCTOR_COMMANDS, items
            assert [command for command, hidden in items if not hidden] == ["nbgrader:open-assignment-list"], items
            sidebar = page.locator(".jp-SideBar.jp-mod-right .lm-TabBar-tab")
            assert "Create Assignment" not in [sidebar.nth(i).get_attribute("title") for i in range(sidebar.count())]
            assert page.request.get(f"{hub.url}/user/alice/formgrader").status == 404

            # Fetch from the Assignments panel, open the lesson from it, run its first code cell.
            page.click(".lm-Menu-itemLabel:text-is('Assignment List')")
            page.click(f"#released_assignments_list .list_item:has-text('{LESSON}') button:text-is('Fetch')")
            page.click(f"#fetched_assignments_list a.assignment-notebooks-link:has-text('{LESSON}')")
            page.click(f"#fetched_assignments_list .nested_list_item a:text-is('{LESSON}')")
            first = page.locator(".jp-NotebookPanel:visible .jp-CodeCell").first
            # Run it once its kernel is up (the status bar reads "Python 3 (ipykernel) | Idle").
            page.locator(".jp-StatusBar-TextItem", has_text="| Idle").wait_for()
            first.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")
            output = first.locator(".jp-OutputArea-output")
            output.wait_for()
            assert output.inner_text().strip() == FIRST_CELL_OUTPUT
            hub.record()
        except BaseException:
            page.screenshot(path=tmp_path / "failed.png")
            print(f"the page when it failed: {tmp_path / 'failed.png'}")
            raise
        finally:
            browser.close()
