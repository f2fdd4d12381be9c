import json

from gradwire.cli import main


def test_compare_prints_a_row_per_compressor(capsys, tmp_path):
    out = tmp_path / "c.json"
    assert main(["compare", "--repeat", "1", "--spec", "fp16", "--spec", "topk:ratio=0.05", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fp16" in text and "topk:ratio=0.05" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["spec"] for r in rows] == ["fp16", "topk:ratio=0.05"]
    assert 1.9 < rows[0]["ratio"] < 2.01
    assert rows[1]["ratio"] > 5 and 0 < rows[1]["rel_l2_error"] < 1


def test_bench_small_run_writes_json(tmp_path):
    out = tmp_path / "b.json"
    assert main(["bench", "--numel", "20000", "--repeat", "1", "--spec", "int8", "--spec", "threshold",
                 "--only", "throughput", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["throughput"]
    assert rows[0]["spec"].startswith("baseline: x.clone()")
    assert rows[-1]["spec"].startswith("threshold:threshold=")
    assert all(r["encode_gbps"] > 0 for r in rows)


def test_bad_spec_is_a_clear_error(capsys):
    assert main(["compare", "--spec", "nosuch"]) == 2
    assert "unknown compressor 'nosuch'" in capsys.readouterr().err


def test_list_states_the_error_feedback_rule(capsys):
    assert main(["list"]) == 0
    rows = {line.split()[0]: line.split()[2] for line in capsys.readouterr().out.splitlines()[1:15] if line.strip()}
    assert rows["topk"] == rows["sign"] == rows["int8"] == "on"
    assert rows["fp16"] == rows["none"] == rows["randomk"] == rows["qsgd"] == "off"
