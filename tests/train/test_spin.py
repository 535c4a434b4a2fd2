"""`flash-cce spin` end to end on the tiny model: pairs whose rejected answer
is the model's generation, resumable, ready for `flash-cce train`."""

import json
import shutil

import pytest
from mlx_lm import generate, load

from flash_cce.train.cli import main
from flash_cce.train.data import load_pairs
from flash_cce.train.demo import demo_records, demo_words
from flash_cce.train.tiny import build_tiny_model
from flash_cce.train.trainer import read_metrics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("spin") / "model", demo_words(), seed=0)


def _sft(path, n=7):
    recs = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in demo_records()["train"][:n]]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def _spin(model, data, out, *extra):
    return main(["spin", "--model", str(model), "--data", str(data), "--out", str(out),
                 "--max-tokens", "5", "--batch-size", "3", "--no-progress", *extra])


def test_greedy_pairs_hold_the_models_own_answers(tiny, tmp_path):
    recs = _sft(tmp_path / "sft.jsonl")
    out = tmp_path / "data" / "train.jsonl"
    out.parent.mkdir()
    assert _spin(tiny, tmp_path / "sft.jsonl", out, "--temp", "0") == 0
    pairs = [json.loads(line) for line in out.read_text().splitlines()]
    model, tok = load(str(tiny))
    assert len(pairs) == len(recs)
    for p, r in zip(pairs, recs):
        assert p["prompt"] == r["prompt"] and p["chosen"] == r["completion"]
        # The same greedy answer, generated one prompt at a time by mlx-lm.
        assert p["rejected"] == generate(model, tok, r["prompt"], max_tokens=5, verbose=False)
    loaded, report = load_pairs(out, tok)  # valid TRL pairs
    assert len(loaded) == len(recs) and report["dropped"] == 0
    # ... and ready for flash-cce train.
    shutil.copy(out, out.parent / "valid.jsonl")
    run = tmp_path / "run"
    assert main(["train", "--model", str(tiny), "--data", str(out.parent), "--run-dir", str(run),
                 "--iters", "3", "--batch-size", "2", "--num-layers", "-1", "--no-progress",
                 "--learning-rate", "0.05", "--lr-schedule", "constant"]) == 0
    assert [r["step"] for r in read_metrics(run) if r["split"] == "train"] == [1, 2, 3]
    # Generating with the run's adapters: mlx-lm's answers with the same adapters.
    again = tmp_path / "again.jsonl"
    assert _spin(tiny, tmp_path / "sft.jsonl", again, "--temp", "0", "--adapter-path",
                 str(run / "adapters")) == 0
    tuned, _ = load(str(tiny), adapter_path=str(run / "adapters"))
    tuned_answers = [json.loads(line)["rejected"] for line in again.read_text().splitlines()]
    assert tuned_answers == [generate(tuned, tok, r["prompt"], max_tokens=5, verbose=False) for r in recs]
    assert tuned_answers != [p["rejected"] for p in pairs]  # the adapters changed the answers


def test_interrupted_run_continues_to_the_same_file(tiny, tmp_path):
    _sft(tmp_path / "sft.jsonl")
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    sampled = ("--temp", "1.0", "--seed", "3")
    assert _spin(tiny, tmp_path / "sft.jsonl", whole, *sampled) == 0
    assert _spin(tiny, tmp_path / "sft.jsonl", cut, *sampled) == 0
    # Stopped after the first batch of 3 records, in the middle of writing the second.
    lines = cut.read_text().splitlines(keepends=True)
    progress = cut.with_name(cut.name + ".progress")
    state = json.loads(progress.read_text())
    progress.write_text(json.dumps(dict(state, records=3, lines=3)))
    cut.write_text("".join(lines[:3]) + lines[3][:10])
    assert _spin(tiny, tmp_path / "sft.jsonl", cut, *sampled) == 0
    assert cut.read_text() == whole.read_text()
    rejected = [json.loads(line)["rejected"] for line in whole.read_text().splitlines()]
    assert len(set(rejected)) > 1  # sampled, not one fixed answer


def test_messages_records_and_errors(tiny, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    user = {"role": "user", "content": "tom has a red ball . what color is the ball ?"}
    data.write_text(json.dumps({"messages": [user, {"role": "assistant", "content": "red ."}]}) + "\n"
                    + json.dumps({"messages": [user]}) + "\n")
    assert _spin(tiny, data, tmp_path / "o.jsonl") == 2
    assert f"{data}:2: 'messages' must be a conversation ending with an assistant turn" in capsys.readouterr().err
    data.write_text(json.dumps({"messages": [user, {"role": "assistant", "content": "red ."}]}) + "\n")
    out = tmp_path / "o.jsonl"
    assert _spin(tiny, data, out, "--max-tokens", "3") == 0
    (pair,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert pair["prompt"] == [user] and pair["chosen"] == [{"role": "assistant", "content": "red ."}]
    assert pair["rejected"][0]["role"] == "assistant"
    other = tmp_path / "other.jsonl"
    other.write_text("{}\n")
    assert _spin(tiny, data, other) == 2
    assert "has no other.jsonl.progress beside it" in capsys.readouterr().err
    assert _spin(tiny, data, tmp_path / "p.jsonl", "--top-p", "0") == 2
    assert "top_p must be in (0, 1], got 0.0" in capsys.readouterr().err


def test_a_full_disk_is_one_line_and_the_run_continues(tiny, tmp_path):
    """A write that fails (here: a file size limit, as on a full disk) stops spin
    with one line naming the file, exit 2; the next run continues the same file."""
    from runs import flash_cce, ok

    data, out = tmp_path / "sft.jsonl", tmp_path / "pairs.jsonl"
    _sft(data, n=9)
    argv = ["spin", "--model", tiny, "--data", data, "--out", out, "--max-tokens", "5", "--batch-size", "3",
            "--no-progress"]
    proc = flash_cce(*argv, file_size_limit=300)  # room for about one batch of pairs
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flash-cce spin: error: cannot write ") and "Traceback" not in proc.stderr
    assert str(out) in err[0] or str(out.with_name(out.name + ".progress")) in err[0]
    ok(flash_cce(*argv))
    assert len(out.read_text().splitlines()) == 9  # every record once, nothing torn or repeated
    assert all(json.loads(line)["rejected"] for line in out.read_text().splitlines())
