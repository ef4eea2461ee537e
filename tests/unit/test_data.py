import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from k3.launch.prepare_data import prepare_data as prepare_data_cmd
from k3.rl.data import prepare as data_mod
from k3.rl.data.prepare import prepare_data, task_paths
from k3.rl.data.records import DataError, DataFormatError, load_prompts, read_records, write_records

DAPO = [
    {"prompt": [{"role": "user", "content": "Find x if 2x = 4."}], "label": "2", "extra": {"id": 1}},
    {"prompt": "What is 1 + 1?", "label": 2},
]
AIME = [{"prompt": "AIME problem", "label": "204"}]


def _jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _closed_port_endpoint() -> str:
    # Bind and release a port: nothing listens there, so any request is refused locally, never sent out.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401

        return True
    except ImportError:
        return False


def test_read_records_accepts_both_prompt_forms_and_numbers(tmp_path):
    p = _jsonl(
        tmp_path / "d.jsonl", [DAPO[0], "", DAPO[1], {"messages": [{"role": "user", "content": "q"}], "label": "1"}]
    )
    recs = read_records(p)
    assert recs == [
        {"prompt": DAPO[0]["prompt"], "label": "2"},
        {"prompt": "What is 1 + 1?", "label": "2"},
        {"prompt": [{"role": "user", "content": "q"}], "label": "1"},
    ]


def test_read_records_reports_every_bad_line_with_its_location(tmp_path):
    rows = [
        DAPO[1],
        '{"prompt": "x", "label": ',
        {"prompt": "x"},
        {"prompt": 5, "label": "1"},
        {"prompt": "x", "label": ""},
        [1, 2],
        {"prompt": [{"role": "robot", "content": "hi"}], "label": "1"},
        {"prompt": "x", "label": True},
    ]
    p = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataFormatError) as ei:
        read_records(p)
    msg = str(ei.value)
    assert f"{p}: 7 bad record(s)" in msg
    assert f"{p}:2: not valid JSON" in msg
    assert f"{p}:3: missing key 'label'" in msg
    assert f"{p}:4: 'prompt': prompt must be a string or a non-empty list" in msg
    assert f"{p}:5: 'label' is empty" in msg
    assert f"{p}:6: expected a JSON object, got list" in msg
    assert f"{p}:7: 'prompt': message 0 has role 'robot'" in msg
    assert f"{p}:8: 'label' must be a string or a number, got bool" in msg
    assert len(ei.value.problems) == 7


def test_read_records_caps_the_listing(tmp_path):
    p = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}] * 30)
    with pytest.raises(DataFormatError, match="and 10 more") as ei:
        read_records(p)
    assert len(ei.value.problems) == 20


def test_read_records_missing_and_empty(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no records"):
        read_records(_jsonl(tmp_path / "empty.jsonl", [""]))


@pytest.mark.skipif(_has_pyarrow(), reason="pyarrow is installed; the missing-pyarrow message cannot show")
def test_parquet_without_pyarrow_says_so(tmp_path):
    p = tmp_path / "train.parquet"
    p.write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"needs pyarrow.*pip install pyarrow"):
        read_records(p)


@pytest.mark.skipif(not _has_pyarrow(), reason="needs pyarrow")
def test_parquet_rows_are_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "q"}], "label": "3"}]), p)
    assert read_records(p) == [{"prompt": [{"role": "user", "content": "q"}], "label": "3"}]


def test_load_prompts_templates_the_last_user_message(tmp_path):
    p = _jsonl(tmp_path / "d.jsonl", DAPO)
    recs = load_prompts(p, prompt_template="{prompt}\nPut the answer in \\boxed{}.")
    assert recs[1] == {
        "prompt": [{"role": "user", "content": "What is 1 + 1?\nPut the answer in \\boxed{}."}],
        "label": "2",
    }
    assert recs[0]["prompt"][0]["content"].startswith("Find x")
    assert load_prompts(p, limit=1) == [{"prompt": DAPO[0]["prompt"], "label": "2"}]
    with pytest.raises(DataError, match="must contain '{prompt}'"):
        load_prompts(p, prompt_template="no placeholder")
    with pytest.raises(DataError, match="limit"):
        load_prompts(p, limit=0)


def test_write_records_is_atomic(tmp_path):
    p = tmp_path / "out" / "x.jsonl"
    write_records(p, DAPO)

    def boom():
        yield DAPO[0]
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_records(p, boom())
    assert [json.loads(line) for line in p.read_text().splitlines()] == DAPO  # old file intact
    assert sorted(os.listdir(p.parent)) == ["x.jsonl"]  # no temp file left behind


def test_task_paths():
    tp = task_paths("dapo-math", "/d")
    assert (tp.train, tp.eval, tp.eval_name) == (
        Path("/d/dapo-math-17k/dapo-math-17k.jsonl"),
        Path("/d/aime-2024/aime-2024.jsonl"),
        "aime",
    )
    assert task_paths("gsm8k", "/d").eval == Path("/d/gsm8k/test.jsonl")
    with pytest.raises(DataError, match="unknown task 'mmlu'"):
        task_paths("mmlu", "/d")


def test_prepare_from_local_lays_out_the_recipe_files(tmp_path):
    src = tmp_path / "downloads"
    dapo = _jsonl(src / "dapo-math-17k.jsonl", DAPO)
    aime = _jsonl(src / "aime-2024" / "aime-2024.jsonl", AIME)  # as left by `hf download --local-dir aime-2024`
    d = tmp_path / "data"
    res = prepare_data("dapo-math", d, src, endpoint=_closed_port_endpoint())
    assert (d / "dapo-math-17k/dapo-math-17k.jsonl").read_bytes() == dapo.read_bytes()
    assert (d / "aime-2024/aime-2024.jsonl").read_bytes() == aime.read_bytes()
    assert [(f.path, f.records) for f in res.files] == [(res.paths.train, 2), (res.paths.eval, 1)]
    # prepared data is reused without any network (the endpoint refuses every connection)
    again = prepare_data("dapo-math", d, endpoint=_closed_port_endpoint())
    assert [f.source for f in again.files] == ["present", "present"]


def test_prepare_from_local_missing_file_changes_nothing(tmp_path):
    src = tmp_path / "downloads"
    _jsonl(src / "dapo-math-17k.jsonl", DAPO)
    d = tmp_path / "data"
    with pytest.raises(DataError, match=r"no aime-2024.jsonl or aime-2024.parquet for zhuzilin/aime-2024.*hf download"):
        prepare_data("dapo-math", d, src)
    assert not d.exists()
    with pytest.raises(DataError, match="no such file or folder"):
        prepare_data("dapo-math", d, tmp_path / "nowhere")


def test_prepare_from_local_bad_records_name_file_and_line(tmp_path):
    src = tmp_path / "downloads"
    _jsonl(src / "dapo-math-17k.jsonl", DAPO)
    bad = _jsonl(src / "aime-2024.jsonl", [AIME[0], {"problem": "x", "label": "1"}])
    d = tmp_path / "data"
    with pytest.raises(DataFormatError, match=f"{bad}:2: missing key 'prompt'"):
        prepare_data("dapo-math", d, src)
    assert not d.exists()  # the valid dapo file was not installed either


def test_prepare_present_but_corrupt_says_force(tmp_path):
    d = tmp_path / "data"
    _jsonl(d / "dapo-math-17k/dapo-math-17k.jsonl", DAPO)
    _jsonl(d / "aime-2024/aime-2024.jsonl", ["{oops"])
    with pytest.raises(DataError, match="--force"):
        prepare_data("dapo-math", d, endpoint=_closed_port_endpoint())


def test_prepare_without_network_says_what_to_fetch_and_where(tmp_path):
    d = tmp_path / "data"
    with pytest.raises(DataError) as ei:
        prepare_data("dapo-math", d, endpoint=_closed_port_endpoint())
    msg = str(ei.value)
    assert "hf download --repo-type dataset zhuzilin/dapo-math-17k --local-dir dapo-math-17k" in msg
    assert "hf download --repo-type dataset zhuzilin/aime-2024 --local-dir aime-2024" in msg
    assert str(d / "dapo-math-17k" / "dapo-math-17k.jsonl") in msg
    assert str(d / "aime-2024" / "aime-2024.jsonl") in msg
    assert f"k3 prepare-data --task dapo-math --data-dir {d} --from-local FOLDER" in msg
    assert not (d / "dapo-math-17k" / "dapo-math-17k.jsonl").exists()


def _fake_hub(files: dict[str, dict[str, bytes]], calls: list):
    def snapshot_download(repo_id, repo_type, local_dir, endpoint=None):
        calls.append((repo_id, repo_type))
        for rel, content in files[repo_id].items():
            p = Path(local_dir) / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content)
        return local_dir

    return snapshot_download


def test_prepare_downloads_through_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    dapo = "".join(json.dumps(r) + "\n" for r in DAPO).encode()
    aime = "".join(json.dumps(r) + "\n" for r in AIME).encode()
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        _fake_hub(
            {
                "zhuzilin/dapo-math-17k": {"dapo-math-17k.jsonl": dapo, "README.md": b"x"},
                "zhuzilin/aime-2024": {"aime-2024.jsonl": aime},
            },
            calls,
        ),
    )
    d = tmp_path / "data"
    res = prepare_data("dapo-math", d)
    assert calls == [("zhuzilin/dapo-math-17k", "dataset"), ("zhuzilin/aime-2024", "dataset")]
    assert [f.source for f in res.files] == ["hub", "hub"]
    assert (d / "dapo-math-17k/dapo-math-17k.jsonl").read_bytes() == dapo
    assert len(read_records(res.paths.eval)) == 1
    prepare_data("dapo-math", d)
    assert len(calls) == 2  # already there: no second download
    prepare_data("dapo-math", d, force=True)
    assert len(calls) == 4


def test_prepare_gsm8k_parquet_source(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    if _has_pyarrow():
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        def pq_bytes(label):
            buf = io.BytesIO()
            pq.write_table(
                pa.Table.from_pylist([{"messages": [{"role": "user", "content": "q"}], "label": label}]), buf
            )
            return buf.getvalue()

        files = {"train.parquet": pq_bytes("1"), "test.parquet": pq_bytes("2")}
    else:
        files = {"train.parquet": b"PAR1", "test.parquet": b"PAR1"}
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _fake_hub({"zhuzilin/gsm8k": files}, calls))
    d = tmp_path / "data"
    if not _has_pyarrow():
        with pytest.raises(DataError, match="needs pyarrow"):
            prepare_data("gsm8k", d)
        return
    res = prepare_data("gsm8k", d)
    assert read_records(res.paths.train) == [{"prompt": [{"role": "user", "content": "q"}], "label": "1"}]
    assert (d / "gsm8k" / "train.parquet").is_file()


def test_prepare_arith_is_generated(tmp_path):
    res = prepare_data("arith", tmp_path, seed=3)
    assert res.paths.eval_name == "arith"
    assert [f.records for f in res.files] == [4096, 128]
    assert read_records(res.paths.train)[0]["prompt"].startswith("What is ")


def test_cli_from_local_prints_the_layout(tmp_path):
    src = tmp_path / "downloads"
    _jsonl(src / "dapo-math-17k.jsonl", DAPO)
    _jsonl(src / "aime-2024.jsonl", AIME)
    app = typer.Typer()
    app.command()(prepare_data_cmd)
    d = tmp_path / "data"
    out = CliRunner().invoke(app, ["--task", "dapo-math", "--data-dir", str(d), "--from-local", str(src)])
    assert out.exit_code == 0, out.output
    assert f"{d / 'dapo-math-17k' / 'dapo-math-17k.jsonl'}  2 records" in out.output
    assert "logged as eval/aime" in out.output
    bad = CliRunner().invoke(
        app, ["--task", "dapo-math", "--data-dir", str(tmp_path / "d2"), "--from-local", str(tmp_path / "nowhere")]
    )
    assert bad.exit_code == 1 and "no such file or folder" in bad.output


def test_cli_offline_end_to_end(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_ENDPOINT=_closed_port_endpoint())
    cmd = [sys.executable, "-m", "k3", "prepare-data", "--task", "dapo-math", "--data-dir", str(tmp_path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "k3 prepare-data: cannot download zhuzilin/dapo-math-17k" in p.stderr
    assert "--from-local FOLDER" in p.stderr
    assert data_mod.TASKS["dapo-math"].train in p.stderr


def test_a_json_error_that_ends_in_at_reads_once(tmp_path):
    """json's own message "Unterminated string starting at" must not become "… at at column 14"."""
    p = tmp_path / "cut.jsonl"
    p.write_text('{"prompt": "x')  # no newline: json then reports the open string
    with pytest.raises(DataFormatError) as ei:
        read_records(p)
    assert f"{p}:1: not valid JSON (Unterminated string starting at column 12)" in str(ei.value)
    assert "at at" not in str(ei.value)
