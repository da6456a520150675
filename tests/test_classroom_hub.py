"""A class on the shipped one-machine hub, end to end on loopback: two students fetch and submit a lesson through
nbgrader's exchange from their servers (the HTTP API the Assignments panel calls); the instructor collects, grades,
returns feedback and exports, with a roster that names a third student who never submitted (``python -m autograde``
release, collect --from-exchange, autograde, feedback, roster, export); each student fetches their feedback. Then
nothing the hub started may be left running or listening.

Needs ``jupyterhub`` and a ``configurable-http-proxy`` (the ``classroom`` extra; PyPI's proxy is pure Python, so no
Node.js); skipped without them except under CI.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import httpx
import nbformat
import pytest

from tests.classroom import LESSON, POINTS, Hub, course_with_lesson, instructor, need_hub

pytestmark = [pytest.mark.slow, pytest.mark.classroom]

ANSWERS = {"alice": "    return 2 * x", "bob": "    return x + 2"}  # bob's fails double(3) == 6
SCORES = {"alice": POINTS, "bob": 0}
ABSENT = "carol"


def nbgrader_call(student: httpx.Client, action: str) -> dict:
    """The assignment list extension's own endpoint (what the Assignments panel's buttons post)."""
    r = student.post(f"/assignments/{action}", data={"course_id": "kvlab", "assignment_id": LESSON})
    r.raise_for_status()
    return r.json()


def answer(student: httpx.Client, body: str) -> None:
    """Write ``body`` into the fetched lesson's answer cell through the contents API, as JupyterLab saves it."""
    path = f"/api/contents/{LESSON}/{LESSON}.ipynb"
    nb = nbformat.from_dict(student.get(path).raise_for_status().json()["content"])
    (cell,) = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "answer"]
    cell.source = re.sub(r"(?m)^\s*raise NotImplementedError.*$", body, cell.source)
    assert body in cell.source, cell.source
    student.put(path, json={"type": "notebook", "format": "json", "content": nb}).raise_for_status()


def feedback_html(student: httpx.Client) -> str:
    """The one feedback page the student fetched (``LESSON/feedback/<time>/LESSON.html`` in their home)."""
    listing = student.get(f"/api/contents/{LESSON}/feedback").raise_for_status().json()["content"]
    (folder,) = listing
    return student.get(f"/api/contents/{folder['path']}/{LESSON}.html").raise_for_status().json()["content"]


def test_two_students_fetch_submit_and_get_feedback_through_the_hub(tmp_path: Path) -> None:
    need_hub()
    exchange = tmp_path / "exchange"
    root = course_with_lesson(tmp_path / "course", exchange)
    roster = tmp_path / "roster.csv"
    roster.write_text("id\n" + "".join(f"{name}\n" for name in [*ANSWERS, ABSENT]))

    with Hub(tmp_path, exchange) as hub:
        students = {name: hub.start_server(name) for name in ANSWERS}
        for name, student in students.items():
            listed = student.get("/assignments", params={"course_id": "kvlab"}).raise_for_status().json()
            assert listed["success"] and [a["assignment_id"] for a in listed["value"]] == [LESSON], listed
            fetched = nbgrader_call(student, "fetch")
            assert [a["status"] for a in fetched["value"]] == ["fetched"], fetched
            answer(student, ANSWERS[name])
            assert nbgrader_call(student, "submit")["success"]

        # Each submission is named after its hub user, though every server runs as one Unix user.
        inbound = sorted(p.name.split("+")[0] for p in (exchange / "kvlab" / "inbound").iterdir())
        assert inbound == sorted(ANSWERS)

        collected = instructor(root, exchange, "collect", "--from-exchange", LESSON)
        assert "cheating" not in collected, collected
        instructor(root, exchange, "autograde", LESSON)
        instructor(root, exchange, "feedback", LESSON)
        instructor(root, exchange, "roster", str(roster))
        grades = tmp_path / "grades.csv"
        instructor(root, exchange, "export", "--to", str(grades))

        for name, student in students.items():
            nbgrader_call(student, "fetch_feedback")
            page = feedback_html(student)
            assert f"{LESSON} (Score: {SCORES[name]:.1f} / {POINTS:.1f})" in page, page[:2000]
            assert "double(-4)" not in page, "the hidden test reached the student's feedback"
            student.close()

    rows = {row["student_id"]: row for row in csv.DictReader(grades.open())}
    assert sorted(rows) == sorted([*ANSWERS, ABSENT])
    for name, points in SCORES.items():
        assert float(rows[name]["score"]) == points and float(rows[name]["max_score"]) == POINTS, rows[name]
        assert rows[name]["timestamp"], f"{name}'s submission time was lost: {rows[name]}"
    assert rows[ABSENT]["score"] == "" and rows[ABSENT]["timestamp"] == "", rows[ABSENT]
