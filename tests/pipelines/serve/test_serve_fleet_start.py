"""A fleet started all at once on an empty PostgreSQL database, as a compose file or systemd starts one: every
process creates the queue's schema or finds it, none fails (issue 44 item 1: the losers of the race saw no table
through their catalog cache, created it again and died of ``DuplicateTable``; the API never answered).

- the queue opened by 4 processes at one instant, 5 rounds on fresh databases: each opens it, one schema row;
- 2 APIs and 2 workers started together on a fresh database, 5 rounds: both APIs answer ``/health`` listing both
  workers, ready.
"""
from __future__ import annotations

import multiprocessing
import time

import pytest

from tests.support.cascade_fixtures import TINY_CONFIG, tiny_cache  # noqa: F401
from tests.support.postgres_harness import postgres  # noqa: F401
from tests.support.serve_harness import Server

ROUNDS = 5
PROCESSES = 4


def _open_at(url: str, instant: float, answers) -> None:
    from pipelines.serve.db.postgres import PostgresQueue

    while time.time() < instant:  # a start line the processes share
        pass
    try:
        PostgresQueue(url, patience=30).close()
        answers.put("opened")
    except Exception as err:  # noqa: BLE001 - what a process died of is the test's answer
        answers.put(f"{type(err).__name__}: {' '.join(str(err).split())}")


def test_four_processes_opening_an_empty_database_at_one_instant_all_open_it(postgres):
    import psycopg

    context = multiprocessing.get_context("spawn")
    for _ in range(ROUNDS):
        url = postgres.new_database()
        answers = context.Queue()
        instant = time.time() + 4  # past every process's imports: they start their transactions together
        processes = [context.Process(target=_open_at, args=(url, instant, answers)) for _ in range(PROCESSES)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
        got = [answers.get(timeout=10) for _ in processes]
        assert got == ["opened"] * PROCESSES, got
        with psycopg.connect(url) as connection:
            assert connection.execute("SELECT key, value FROM pixal3d_meta").fetchall() == [("schema", "1")]


def test_two_apis_and_two_workers_started_together_on_an_empty_database_all_answer(postgres, tiny_cache,
                                                                                  tmp_path):
    for round_ in range(ROUNDS):
        folder = tmp_path / f"round{round_}"
        folder.mkdir()
        common = ["--config", str(TINY_CONFIG), "--queue", postgres.new_database()]
        data = folder / "data"
        apis = [Server.spawn(data, *common, "--role", "api", log=f"api{i}") for i in (1, 2)]
        workers = [Server.spawn(data, *common, "--role", "worker", "--name", name, "--devices", "cpu",
                                "--threads", "1", log=name) for name in ("a", "b")]
        processes = [*apis, *workers]
        try:
            for process in processes:
                process.started(ready=False)
            deadline = time.monotonic() + 120
            for api in apis:
                while True:
                    health = api.get("/health").json()
                    if health["ready"] and sorted(w["name"] for w in health["workers"]) == ["a", "b"]:
                        break
                    assert time.monotonic() < deadline, health
                    time.sleep(0.2)
        except (RuntimeError, TimeoutError, AssertionError) as err:
            logs = "\n".join(f"--- {p.log.name}\n{p.tail()}" for p in processes)
            pytest.fail(f"round {round_}: {err}\n{logs}")
        finally:
            for process in processes:
                process.stop()


def test_a_data_folder_another_process_is_making_is_taken_and_somebody_elses_is_refused(tmp_path):
    """Processes started at once make one data folder: one of them finds the folder with ``jobs/`` made and the
    work directory's marker still a temporary file, and used to refuse it as "not a data folder" (round 0 of the
    test above, once). A folder holding anything else is still refused."""
    from pipelines.serve.store import DataDirError, DataFolder
    from pipelines.work_dir import MARKER, WorkDir, WorkDirError

    being_made = tmp_path / "data"
    (being_made / "jobs").mkdir(parents=True)
    (being_made / "work").mkdir()
    (being_made / "work" / f".{MARKER}.1a2b3c.tmp").write_text("{")
    DataFolder(being_made)
    for maker, refused, error in ((DataFolder, "data2", DataDirError), (WorkDir, "work2", WorkDirError)):
        (tmp_path / refused).mkdir()
        (tmp_path / refused / "notes.txt").write_text("mine")
        with pytest.raises(error, match="already holds files"):
            maker(tmp_path / refused)


@pytest.mark.parametrize("kind", ["data", "work"])
def test_a_folder_whose_marker_another_process_writes_while_it_is_looked_at_is_taken(kind, tmp_path, monkeypatch):
    """CI at 1eddfd8, round 0 of the fleet test above: the second API looked for the work directory's marker (not
    yet there), the first API then wrote it, and the listing that followed saw the marker itself as somebody
    else's file. Here the other process writes its marker and then a folder of its own while this one lists the
    folder: taken (under the old order, marker first and listing second, this raised "already holds files")."""
    from pathlib import Path

    from pipelines.serve import store
    from pipelines.work_dir import MARKER, WorkDir

    maker, marker = (store.DataFolder, store.MARKER) if kind == "data" else (WorkDir, MARKER)
    folder = tmp_path / kind
    folder.mkdir()
    real_iterdir = Path.iterdir

    def other_process_meanwhile(path):
        if path == folder and not (folder / marker).exists():
            (folder / marker).write_text('{"format": 1}')
            (folder / "an_image").mkdir()
        return real_iterdir(path)

    monkeypatch.setattr(Path, "iterdir", other_process_meanwhile)
    maker(folder)
    assert (folder / marker).exists()
