"""What a client reads names the client's files, never the server's data folder (issue 44 item 5): the paths a
check or a run puts in an error (``<data>/jobs/<id>/views/transforms.json``, a stage record under ``<data>/work``)
become the names the client sent, "the uploaded views", "the uploaded input"; a failed job's view shows its error
so. Control: the raw lines do name the folder."""
from __future__ import annotations

from pipelines.serve.db import open_queue
from pipelines.serve.service import Jobs
from pipelines.serve.store import DataFolder

JOB = "0123456789abcdef0123456789abcdef"


def test_paths_under_the_data_folder_become_the_clients_words(tmp_path):
    data = DataFolder(tmp_path / "data")
    job, work = data.jobs / JOB, data.work.root / JOB
    cases = {
        f"{job}/views/transforms.json: frame 3's file v.png does not exist in {job}/views; check file_path":
            "transforms.json: frame 3's file v.png does not exist in the uploaded views; check file_path",
        f"num_views=5 is above the 4 frames {job}/views/transforms.json gives":
            "num_views=5 is above the 4 frames transforms.json gives",
        f"image {job}/input.png: truncated": "image the uploaded input: truncated",
        f"{work}/structure.safetensors is damaged": "structure.safetensors is damaged",
        f"{data.jobs}/.new-1f2e/views/b.png is no image": "b.png is no image",
        f"cannot write {data.root}/traces/x.jsonl": "cannot write the server's data folder/traces/x.jsonl",
    }
    for raw, words in cases.items():
        assert str(data.root) in raw  # the control: the raw line names the server's folder
        assert data.for_client(raw) == words
        assert str(data.root) not in data.for_client(raw)


def test_a_failed_jobs_view_gives_its_error_in_the_clients_words(tmp_path):
    data = DataFolder(tmp_path / "data")
    queue = open_queue(None, data.root)
    try:
        jobs = Jobs(queue, data, queue_size=10, keep_seconds=None, wake=lambda: None)
        row = jobs.submit(b"\x89PNG fake", ".png", {"seed": 1})
        [claim] = queue.claim("w", 0, "cpu", group_size=1, lease=30)
        error = f"{data.folder(row.id)}/views/transforms.json has no 'frames' list"
        assert queue.finish(row.id, "w", claim.attempt, {"status": "failed", "error": error})
        assert jobs.view(row.id)["error"] == "transforms.json has no 'frames' list"
    finally:
        queue.close()
