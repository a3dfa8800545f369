"""The local API is not a root shell (real daemons running as root, a real unprivileged user
created for the test and removed after; root only):

- the API knows the caller (SO_PEERCRED): another user's job, its logs and outputs are refused
  (403 naming the job and its owner), it cannot be cancelled, and `jobs` hides it;
- a job's data is read by fusionctl as the submitting user: a root-only corpus is refused
  with EACCES on the user's side, and a hand-made upload naming it without carrying it is
  refused by the daemon, which never opens it;
- a job's outputs are written by fusionctl as that user: an output in /etc is refused
  (fusionctl cannot write there), the daemon never creates it, and outputs that land are owned
  by the user; a write that fails (EACCES) exits 7 naming the file, and `fusionctl fetch`
  writes them once the directory is writable again;
- absurd numbers in a request are a 400 naming the field, not a 500.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from fusiond.jobs.results import load_model_state
from fusiond.train.model import build_model
from fusiond.train.spec import load_job
from tests.daemon.harness import Cluster
from tests.e2e.conftest import ctl, leader_and_other
from tests.e2e.test_jobs import GPT2, TEXT
from tests.users import PlainUser, let_in, plain_user

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(600)]


def _corpus_of(user: PlainUser) -> Path:
    """A copy of the test corpus that only `user` can read (their home, 0700/0600)."""
    dst = user.home / "corpus"
    if not dst.exists():
        shutil.copytree(TEXT, dst, ignore=shutil.ignore_patterns("__pycache__"))
        for p in [dst, *dst.rglob("*")]:
            os.chown(p, user.uid, user.gid)
            os.chmod(p, 0o700 if p.is_dir() else 0o600)
    return dst


def _job_for(user: PlainUser, name: str, template: str, **subst: str) -> Path:
    """A job file in the user's home (theirs, 0600) training on the user's own copy of the
    corpus, its output under their home unless `output` is given."""
    subst.setdefault(str(TEXT), str(_corpus_of(user)))
    text = template.replace("{out}", subst.pop("output", str(user.home / f"{name}-out")))
    for k, v in subst.items():
        text = text.replace(k, v)
    p = user.home / f"{name}.toml"
    p.write_text(text)
    os.chown(p, user.uid, user.gid)
    os.chmod(p, 0o600)
    return p


def _short(template: str, steps: int = 3) -> str:
    return template.replace("steps = 20", f"steps = {steps}")


def test_another_users_job_is_refused_and_hidden(cluster3: Cluster, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    _, node = leader_and_other(cluster3)  # forwarded: the submitting daemon keeps the owner
    job = tmp_path / "long.toml"
    job.write_text(GPT2.replace("steps = 20", "steps = 100000").replace("{out}",
                                                                        str(tmp_path / "out")))
    rc, res, err = ctl(node, "submit", str(job), "--stages", "2", "--detach", "--json",
                       capsys=capsys)
    assert rc == 0, err
    root_job = res["job_id"]
    try:
        with plain_user() as user:
            let_in(node.socket, user)
            for args in (["job", root_job], ["logs", root_job], ["cancel", root_job],
                         ["fetch", root_job, "--output", str(user.home / "stolen")]):
                r = user.fusionctl(node.socket, *args)
                assert r.returncode == 1, (args, r.stdout, r.stderr)
                assert f"job {root_job} belongs to uid 0 (root)" in r.stderr, r.stderr
                assert f"uid {user.uid} ({user.name})" in r.stderr, r.stderr
            assert not (user.home / "stolen").exists()
            assert node.api("GET", f"/v1/jobs/{root_job}?history=0")["state"] == "running"
            r = user.fusionctl(node.socket, "jobs", "--json")
            assert r.returncode == 0, r.stderr
            listed = json.loads(r.stdout)
            assert root_job not in {j["job_id"] for j in listed["jobs"]}
            assert listed["hidden"] >= 1
            # the user's own job: theirs to see; root (the operator) sees it too
            mine = _job_for(user, "mine", _short(GPT2))
            r = user.fusionctl(node.socket, "submit", str(mine), "--stages", "2", "--json")
            assert r.returncode == 0, r.stderr[-3000:]
            done = json.loads(r.stdout)
            assert done["state"] == "done" and done["owner_uid"] == user.uid
            model = Path(done["written"]["model.safetensors"])
            assert model == user.home / "mine-out" / "model.safetensors"
            # written by fusionctl as the user, not by the root daemon
            assert model.stat().st_uid == user.uid
            assert (model.parent / "metrics.json").stat().st_uid == user.uid
            fresh = build_model(load_job(mine).model)
            fresh.load_state_dict(load_model_state(model), strict=True)
            r = user.fusionctl(node.socket, "jobs", "--json")
            assert done["job_id"] in {j["job_id"] for j in json.loads(r.stdout)["jobs"]}
            rc, seen, err = ctl(node, "job", done["job_id"], "--json", capsys=capsys)
            assert rc == 0 and seen["owner_uid"] == user.uid, err
    finally:
        rc, _, err = ctl(node, "cancel", root_job, "--json", capsys=capsys)
        assert rc == 0, err


def test_data_and_outputs_are_read_and_written_as_the_submitting_user(
        cluster3: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fusiond.jobs.submit import prepare_job
    from fusiond.jobs.upload import encode_upload

    _, node = leader_and_other(cluster3)
    secret_dir = Path(tempfile.mkdtemp(prefix="fzsecret"))  # 0700 root
    secret = secret_dir / "secret.txt"
    secret.write_text("root's secret text " * 4000)
    os.chmod(secret, 0o600)
    etc_out = Path(f"/etc/fusion-test-{secrets.token_hex(3)}")
    before = {j["job_id"] for j in node.api("GET", "/v1/jobs")["jobs"]}
    try:
        with plain_user() as user:
            let_in(node.socket, user)
            # a root-only corpus: fusionctl reads it as the user, and cannot
            job = _job_for(user, "secret", _short(GPT2), **{str(TEXT): str(secret)})
            r = user.fusionctl(node.socket, "submit", str(job), "--stages", "2")
            assert r.returncode == 1, r.stderr
            assert "job refused" in r.stderr and "Permission denied" in r.stderr, r.stderr
            # an output in /etc: fusionctl cannot write there, and says so before it trains
            job = _job_for(user, "etc", _short(GPT2), output=str(etc_out))
            r = user.fusionctl(node.socket, "submit", str(job), "--stages", "2")
            assert r.returncode == 1, r.stderr
            assert f"the outputs go to {etc_out}" in r.stderr and "permission denied" in \
                r.stderr, r.stderr
            # a hand-made upload that names the secret and /etc without carrying the data: the
            # daemon refuses it; it opens neither path on the user's behalf
            prepared = prepare_job(_job_for(user, "raw", _short(GPT2), output=str(etc_out)))
            meta = {"toml": prepared.toml_text.replace(str(_corpus_of(user)), str(secret)),
                    "base": prepared.base, "out_base": prepared.out_base, "stages": 2}
            body = user.home / "upload.bin"
            body.write_bytes(encode_upload(meta, prepared.graph_bytes, prepared.state_bytes))
            os.chown(body, user.uid, user.gid)
            post = ("import sys, json\nfrom fusionctl.client import Client, Endpoint, ApiFailure\n"
                    f"c = Client(Endpoint(socket_path={node.socket!r}), timeout=120)\n"
                    "raw = open('upload.bin', 'rb').read()\n"
                    "for q in ('?dry_run=1', ''):\n"
                    "    try:\n"
                    "        print(json.dumps(c.request('POST', '/v1/jobs' + q, raw=raw)))\n"
                    "    except ApiFailure as e:\n"
                    "        print(json.dumps({'status': e.status, 'message': e.message}))\n")
            import sys

            r = user.run([sys.executable, "-c", post])
            assert r.returncode == 0, r.stderr[-3000:]
            answers = [json.loads(x) for x in r.stdout.splitlines()]
            assert [a.get("status") for a in answers] == [400, 400], answers
            assert all("never reads a path on a user's behalf" in a["message"]
                       for a in answers), answers
            assert not etc_out.exists()
            # a write that fails at the end (the directory became read-only): exit 7 naming
            # the file and the cause; `fetch` writes the outputs once it is writable again
            out = user.home / "ro-out"
            out.mkdir()
            os.chown(out, user.uid, user.gid)
            job = _job_for(user, "ro", _short(GPT2), output=str(out))
            r = user.fusionctl(node.socket, "submit", str(job), "--stages", "2", "--detach",
                               "--json")
            assert r.returncode == 0, r.stderr[-3000:]
            job_id = json.loads(r.stdout)["job_id"]
            os.chmod(out, 0o500)

            def ended() -> tuple[bool, str]:
                st = node.api("GET", f"/v1/jobs/{job_id}?history=0")["state"]
                return st != "running", st

            cluster3.wait_for(ended, 120.0, f"job {job_id} ending")
            r = user.fusionctl(node.socket, "fetch", job_id)
            assert r.returncode == 7, (r.stdout, r.stderr)
            assert f"could not write {out}/" in r.stderr and "Permission denied" in r.stderr
            assert list(out.iterdir()) == []  # nothing half-written, no temporary file
            os.chmod(out, 0o700)
            r = user.fusionctl(node.socket, "fetch", job_id, "--json")
            assert r.returncode == 0, r.stderr
            assert (out / "model.safetensors").stat().st_uid == user.uid
            assert sorted(p.name for p in out.iterdir()) == ["metrics.json",
                                                             "model.safetensors"]
    finally:
        shutil.rmtree(secret_dir, ignore_errors=True)
        if etc_out.exists():
            shutil.rmtree(etc_out, ignore_errors=True)
            pytest.fail(f"{etc_out} was created")
    after = node.api("GET", "/v1/jobs")["jobs"]
    # the refused submissions started nothing; only the read-only one ran
    assert len([j for j in after if j["job_id"] not in before]) == 1


def test_absurd_numbers_are_refused_with_400_not_500(cluster3: Cluster) -> None:
    from fusionctl.client import ApiFailure

    node = cluster3.nodes[0]  # holds the cluster CA: it mints tokens
    for body, needle in (({"ttl_s": 1e300}, "ttl_s must be a number in (0, "),
                         ({"ttl_s": -1}, "got -1"), ({"ttl_s": True}, "got True"),
                         ({"one_time": "yes"}, "one_time must be true or false")):
        with pytest.raises(ApiFailure) as e:
            node.api("POST", "/v1/token", body)
        assert e.value.status == 400 and needle in e.value.message, (body, e.value.message)
    for q in ("history=-1", "history=1e9", "history=nan"):
        with pytest.raises(ApiFailure) as e:
            node.api("GET", f"/v1/jobs/nope-000000?{q}")
        assert e.value.status == 400 and "history must be" in e.value.message
    assert node.api("POST", "/v1/token", {"ttl_s": 60})["one_time"] is True
    assert node.status() is not None  # nothing crashed


def test_a_daemon_running_as_its_own_user_serves_a_job_it_could_not_write(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped unit runs fusiond as `fusion` (with ProtectHome=, ProtectSystem=strict): it
    can write only its state dir. A job submitted from a directory the daemon cannot enter
    (here root's 0700 pytest directory) trains and is written there by fusionctl; before, the
    daemon trained every step and then failed, unable to write runs/<name>."""
    import signal
    import subprocess
    import sys

    from fusionctl.local import LocalNode, agreement, make_credentials, merge, wait_until
    from tests.daemon.harness import TIMERS
    from tests.users import REPO

    root = Path(tempfile.mkdtemp(prefix="fzu"))
    os.chmod(root, 0o755)
    proc: subprocess.Popen[bytes] | None = None
    with plain_user("fzd") as daemon_user:
        try:
            node = LocalNode(0, root, merge(TIMERS, {"job_memory_gib": 0.03}))
            node.write_config()
            make_credentials([node])
            for p in [node.dir, *node.dir.rglob("*")]:
                os.chown(p, daemon_user.uid, daemon_user.gid)
            env = {"HOME": str(daemon_user.home), "PATH": os.environ.get("PATH", ""),
                   "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            with node.log_path.open("ab") as log:
                proc = subprocess.Popen(
                    ["setpriv", f"--reuid={daemon_user.uid}", f"--regid={daemon_user.gid}",
                     "--clear-groups", "--", sys.executable, "-m", "fusiond", "--config",
                     str(node.config_path)], stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            ok, why, _ = wait_until(lambda: agreement([node.status(1.0)], 1), 60.0)
            assert ok, f"{why}\n{node.log_text()[-3000:]}"
            out = tmp_path / "out"  # root's 0700 directory: the daemon cannot write here
            corpus = root / "corpus"  # readable by all, as in the report: the output is the issue
            shutil.copytree(TEXT, corpus, ignore=shutil.ignore_patterns("__pycache__"))
            job = tmp_path / "job.toml"
            job.write_text(_short(GPT2).replace("{out}", str(out)).replace(str(TEXT),
                                                                          str(corpus)))
            rc, res, err = ctl(node, "submit", str(job), "--stages", "1", "--json",
                               capsys=capsys)
            assert rc == 0 and res["state"] == "done", err[-3000:] + node.log_text()[-3000:]
            assert (out / "model.safetensors").stat().st_uid == 0  # fusionctl (root) wrote it
            stored = node.state_dir / "outputs" / res["job_id"] / "model.safetensors"
            assert stored.stat().st_uid == daemon_user.uid  # the daemon's own copy
            assert oct(stored.stat().st_mode & 0o777) == "0o600"
        finally:
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            shutil.rmtree(root, ignore_errors=True)
