"""Job records of an earlier version (a plan this version cannot run) are left out, not an error."""
import json
import time

from api.jobs import JobDB


def test_a_record_with_an_old_plan_is_skipped(tmp_path):
    db = JobDB(tmp_path)
    db._conn.execute("INSERT INTO jobs (id, fingerprint, state, plan, created_at) VALUES (?, ?, ?, ?, ?)",
                     ("job-old", "f", "succeeded", json.dumps({"run_id": "fadrm-0", "config": {}}), time.time()))
    assert db.get("job-old") is None
    assert db.page(None, 10, None) == [] and db.in_state("succeeded") == []
    db.close()
