"""Property-based fuzz of `flash-cce train`'s input checks: generated bad settings
(YAML), flag lists and JSONL records each end in one clear error line (exit 2,
no traceback) and leave the run directory as it was.

The bad values are bad by construction (a type the setting does not take, a
number below its range, a name that is not a setting), not picked by the code
under test. Most cases call `flash_cce.train.cli.main` in this process (the function
the `flash-cce` script runs); a few go through a subprocess too.
`--fuzz-examples N` sets the examples per in-process test (default 1140 in
all, plus 8 through the script; N / 25 through the script). Resume-time damage
(a checkpoint file missing, truncated, replaced by garbage or by one that does
not fit) ends the same way, naming the file, with nothing rewritten.
"""

import contextlib
import io
import json
import shutil
import string

import pytest
import yaml
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from runs import flash_cce, one_line_error, snapshot, train_argv
from test_trainer import tiny_setup

from flash_cce.train import mlx_lm_config, settings
from flash_cce.train.cli import main

DEFAULT_EXAMPLES = {"yaml": 500, "flags": 300, "records": 300, "subprocess": 8, "resume": 40}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    model_dir, data_dir = tiny_setup(tmp)
    finished = tmp / "finished"
    assert main([str(a) for a in train_argv(model_dir, data_dir, finished, 2)]) == 0
    return tmp, model_dir, data_dir, finished


def run_property(request, name, strategy, check):
    """Runs `check` on `strategy`'s examples; returns how many ran."""
    n = request.config.getoption("--fuzz-examples") or DEFAULT_EXAMPLES[name]
    if name == "subprocess":  # a process per case: a small share
        n = max(DEFAULT_EXAMPLES[name], n // 25)
    count = [0]

    @hsettings(max_examples=n, deadline=None, database=None, derandomize=True,
               suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(case):
        count[0] += 1
        check(case)

    prop()
    assert count[0] >= n
    return count[0]


def in_process(argv):
    """(exit status, stderr) of `flash-cce ARGV` run by `main` in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, err.getvalue()


def assert_one_line_error(rc, err, *needles):
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("flash-cce") and ": error: " in lines[0], err
    for n in needles:
        assert n in lines[0], (n, err)


# ---- bad values by construction ------------------------------------------

TEXT = st.text(string.ascii_letters + string.digits + " .-_/", min_size=0, max_size=12)
NUMBER = st.one_of(st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False, width=32))
BAD_CONTAINERS = st.one_of(st.lists(st.integers(), min_size=1, max_size=3),
                           st.dictionaries(TEXT, st.integers(), min_size=1, max_size=2))


def below(s):
    """Numbers under the setting's range (not its special values)."""
    if s.low is None:
        return st.nothing()
    low = s.low
    if s.kind in ("int", "auto_int"):
        top = int(low) - (0 if s.low_open else 1)
        return st.integers(top - 10**6, top).filter(lambda v: v not in s.special)
    return st.floats(low - 1e6, low, exclude_max=not s.low_open, width=64)


def bad_values(s):
    """Values `s` refuses, by its type and range alone."""
    not_none = st.none() if not s.optional else st.nothing()
    if s.kind == "int":
        return st.one_of(TEXT, st.booleans(), st.floats(allow_nan=True).filter(lambda v: v != int(v) if v == v and abs(v) != float("inf") else True),
                         BAD_CONTAINERS, below(s), not_none)
    if s.kind == "float":
        return st.one_of(TEXT, st.booleans(), BAD_CONTAINERS, below(s), not_none,
                         st.sampled_from([float("nan"), float("inf")]))
    if s.kind == "bool":
        return st.one_of(TEXT, st.integers(), st.floats(), BAD_CONTAINERS, not_none)
    if s.kind == "str":
        texts = TEXT.filter(lambda v: v not in s.choices) if s.choices else st.nothing()  # free text: any
        return st.one_of(texts, NUMBER, st.booleans(), BAD_CONTAINERS, not_none)
    if s.kind == "path":
        return st.one_of(NUMBER, st.booleans(), BAD_CONTAINERS, st.just(""), not_none)
    if s.kind == "auto_int":
        return st.one_of(TEXT.filter(lambda v: v != "auto"), st.booleans(), BAD_CONTAINERS, below(s), not_none)
    if s.kind == "auto_bool":
        return st.one_of(TEXT.filter(lambda v: v != "auto"), NUMBER, BAD_CONTAINERS, st.none())
    if s.kind == "str_list":
        return st.one_of(NUMBER, st.just([]), st.lists(NUMBER, min_size=1, max_size=3), st.booleans())
    if s.kind == "float_list":
        return st.one_of(TEXT, NUMBER, st.just([]), st.lists(TEXT, min_size=1, max_size=3), st.booleans(),
                         st.lists(st.sampled_from([float("nan"), float("inf")]), min_size=1, max_size=2))
    if s.kind == "schedule":  # a name, or mlx_lm's mapping (null is mlx_lm's constant rate)
        return st.one_of(TEXT.filter(lambda v: v not in s.choices), NUMBER, st.booleans(),
                         st.lists(st.integers(), min_size=1, max_size=3),
                         st.fixed_dictionaries({"name": TEXT.filter(lambda v: v not in mlx_lm_config.SCHEDULES),
                                                "arguments": st.just([1e-5, 10])}),
                         st.fixed_dictionaries({"name": st.just("cosine_decay"),
                                                "arguments": st.lists(NUMBER, max_size=5).filter(
                                                    lambda a: not (2 <= len(a) <= 3 and a[0] > 0))}))
    raise AssertionError(s.kind)


PLAIN = [s for s in settings.SETTINGS if s.kind != "table"]
TABLES = [s for s in settings.SETTINGS if s.kind == "table"]
NAMES = st.from_regex(r"[a-z][a-z_]{1,20}", fullmatch=True)


@st.composite
def bad_config(draw):
    """(YAML mapping, the key the error must name)."""
    kind = draw(st.sampled_from(["value", "value", "value", "unknown", "table field", "table key",
                                 "together"]))
    if kind == "value":
        s = draw(st.sampled_from(PLAIN))
        return {s.name: draw(bad_values(s))}, s.name
    if kind == "unknown":
        name = draw(NAMES.filter(lambda n: n not in settings.BY_NAME and n not in mlx_lm_config.KEYS))
        return {name: draw(st.one_of(NUMBER, TEXT))}, repr(name)
    table = draw(st.sampled_from(TABLES))
    if kind == "table field":
        f = draw(st.sampled_from(table.fields))
        return {table.name: {f.name: draw(bad_values(f))}}, f"{table.name}.{f.name}"
    if kind == "table key":
        name = draw(NAMES.filter(lambda n: n not in {f.name for f in table.fields}))
        return {table.name: {name: 1}}, repr(name)
    lr = draw(st.floats(1e-8, 1.0))
    iters = draw(st.integers(1, 1000))
    return draw(st.sampled_from([
        ({"learning_rate": lr, "min_learning_rate": lr * draw(st.floats(1.01, 100))}, "min_learning_rate"),
        ({"iters": iters, "warmup": iters + draw(st.integers(0, 10))}, "warmup"),
    ]))


def test_bad_yaml_settings(env, request, tmp_path_factory):
    tmp, model_dir, data_dir, finished = env
    before = snapshot(finished)
    path = tmp_path_factory.mktemp("yaml") / "c.yaml"

    def check(case):
        cfg, key = case
        where = dict(model=str(model_dir), data=str(data_dir), run_dir=str(finished), progress=False)
        path.write_text(yaml.safe_dump(dict(where, **cfg)))
        rc, err = in_process(["train", "-c", path])
        assert_one_line_error(rc, err, key)

    run_property(request, "yaml", bad_config(), check)
    assert snapshot(finished) == before


FLAGS = [s for s in settings.SETTINGS if "train" in s.commands and s.flag and s.kind != "bool"]


@st.composite
def bad_flags(draw):
    """A flag list with at least one bad element, in a random place."""
    good = []
    for s in draw(st.lists(st.sampled_from(FLAGS), max_size=4, unique_by=lambda s: s.name)):
        # Only a setting's own default is sure to be good beside any other (a setting
        # without one, such as loss_type, has no value that every objective accepts).
        if s.default is None or s.name in ("model", "data", "run_dir", "resume", "init_adapters",
                                            "gpu_capture", "config"):
            continue
        good.append([s.flag_name, str(s.default)])
    kind = draw(st.sampled_from(["value", "unknown flag", "missing value", "stray"]))
    if kind == "value":
        s = draw(st.sampled_from([s for s in FLAGS if s.kind in ("int", "float", "auto_int")]))
        text = draw(st.one_of(TEXT.filter(lambda t: not _number_text(t) and t.lower() not in
                                          ("auto", "none", "null")), below(s).map(repr)))
        bad, needle = [s.flag_name, text], s.name if _number_text(text) else s.flag_name
    elif kind == "unknown flag":
        name = draw(NAMES.filter(lambda n: n not in settings.BY_NAME and n not in settings.NESTED_FLAGS
                                 and n not in mlx_lm_config.FLAGS))
        bad, needle = ["--" + name.replace("_", "-"), "1"], "unrecognized arguments"
    elif kind == "missing value":
        s = draw(st.sampled_from([s for s in FLAGS if s.kind != "auto_bool"]))  # alone: true
        bad, needle = [s.flag_name], s.flag_name
    else:
        bad, needle = [draw(TEXT.filter(lambda t: t and not t.startswith("-")))], "unrecognized arguments"
    # A later good value of the bad flag's own setting would override it (argparse keeps the last).
    good = [g for g in good if g[0] != bad[0]]
    at = draw(st.integers(0, len(good)))
    return sum(good[:at], []) + bad + sum(good[at:], []), needle


def _number_text(t):
    try:
        float(t)
        return True
    except ValueError:
        return False


def test_bad_flag_lists(env, request):
    tmp, model_dir, data_dir, finished = env
    before = snapshot(finished)

    def check(case):
        flags, needle = case
        rc, err = in_process(["train", "--model", model_dir, "--data", data_dir, "--run-dir", finished,
                              *flags])
        assert_one_line_error(rc, err, needle)

    run_property(request, "flags", bad_flags(), check)
    assert snapshot(finished) == before


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": TEXT})


@st.composite
def bad_record(draw):
    """A JSONL line (bytes) that is not a TRL preference record."""
    good = {"prompt": "tom has a red ball .", "chosen": "red .", "rejected": "blue ."}
    kind = draw(st.sampled_from(["not json", "not utf-8", "not an object", "missing key",
                                 "wrong type", "empty response", "mixed", "bad message"]))
    if kind == "not json":
        text = draw(TEXT.filter(lambda t: t.strip() and not _json(t)))
        return text.encode()
    if kind == "not utf-8":
        pos = draw(st.integers(0, 20))
        raw = json.dumps(good).encode()
        return raw[:pos] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\x80", b"\xe2\x82"])) + raw[pos:]
    if kind == "not an object":
        rec = draw(st.one_of(NUMBER, TEXT, st.lists(st.integers(), max_size=3), st.booleans(), st.none()))
    elif kind == "missing key":
        gone = draw(st.sampled_from(["chosen", "rejected"]))
        rec = {k: v for k, v in good.items() if k != gone}
    elif kind == "wrong type":
        rec = dict(good, **{draw(st.sampled_from(list(good))): draw(st.one_of(NUMBER, st.booleans(), st.none(),
                                                                               st.dictionaries(TEXT, TEXT, max_size=2)))})
    elif kind == "empty response":
        rec = dict(good, **{draw(st.sampled_from(["chosen", "rejected"])): draw(st.sampled_from(["", " ", "\t"]))})
    elif kind == "mixed":
        rec = dict(good, chosen=[{"role": "assistant", "content": "red ."}])
    else:
        rec = dict(prompt=[draw(MESSAGE)], chosen=[{"role": "assistant", "content": "red ."}],
                   rejected=[draw(st.one_of(st.just({"role": "assistant"}), NUMBER, TEXT,
                                            st.fixed_dictionaries({"role": NUMBER, "content": TEXT})))])
    return json.dumps(rec).encode()


def _json(t):
    try:
        json.loads(t)
        return True
    except ValueError:
        return False


def test_bad_jsonl_records(env, request, tmp_path_factory):
    tmp, model_dir, data_dir, _ = env
    data = tmp_path_factory.mktemp("records")
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_bytes((data_dir / f"{split}.jsonl").read_bytes())
    good = (data_dir / "train.jsonl").read_bytes().splitlines()
    run = data / "run"

    def check(case):
        line, at, split = case
        lines = (good[:at] + [line] + good[at:]) if split == "train" else good
        (data / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        valid = (data_dir / "valid.jsonl").read_bytes().splitlines()
        if split == "valid":
            valid = valid[:at] + [line] + valid[at:]
        (data / "valid.jsonl").write_bytes(b"\n".join(valid) + b"\n")
        rc, err = in_process(["train", "--model", model_dir, "--data", data, "--run-dir", run, "--no-progress",
                              "--num-layers", "-1"])
        assert_one_line_error(rc, err, f"{split}.jsonl:{at + 1}: ")
        assert not run.exists()

    run_property(request, "records", st.tuples(bad_record(), st.integers(0, 8),
                                               st.sampled_from(["train", "valid"])), check)


def test_bad_configs_through_the_script(env, request, tmp_path_factory):
    """A few generated cases through `flash-cce` in a subprocess: the same errors."""
    tmp, model_dir, data_dir, finished = env
    before = snapshot(finished)
    path = tmp_path_factory.mktemp("yaml-sub") / "c.yaml"

    def check(case):
        (cfg, key), (flags, needle) = case
        where = dict(model=str(model_dir), data=str(data_dir), run_dir=str(finished))
        path.write_text(yaml.safe_dump(dict(where, **cfg)))
        proc = flash_cce("train", "-c", path)
        one_line_error(proc, key)
        proc = flash_cce("train", "--model", model_dir, "--data", data_dir, "--run-dir", finished, *flags)
        one_line_error(proc, needle)

    run_property(request, "subprocess", st.tuples(bad_config(), bad_flags()), check)
    assert snapshot(finished) == before


@pytest.mark.parametrize("flags, needles", [
    (["--objective", "dpo", "--loss-type", "exo_pair"], ("label_smoothing", "exo_pair")),
    (["--objective", "orpo", "--loss-type", "bco_pair"], ("loss_type", "orpo")),
])
def test_objective_combinations_are_one_line_errors(env, flags, needles):
    """Settings valid alone but not together are refused before anything is written."""
    tmp, model_dir, data_dir, _ = env
    run_dir = tmp / f"combination-{flags[-1]}"
    rc, err = in_process([*train_argv(model_dir, data_dir, run_dir, 2), *flags])
    assert_one_line_error(rc, err, *needles)
    assert not run_dir.exists()


# ---- resume-time damage ----------------------------------------------------

CHECKPOINT_FILES = ("adapters.safetensors", "optimizer.safetensors", "trainer_state.json")
STATE_KEYS = ("step", "position", "rng", "best_val", "best_step")
NOT_A_COUNT = st.one_of(st.integers(-10**6, -1), TEXT, st.booleans(), st.floats(0.5, 1e6).filter(lambda v: v != int(v)),
                        st.lists(st.integers(), max_size=2))
BAD_STATE_VALUES = {
    "step": st.one_of(NOT_A_COUNT, st.none()),
    "position": st.one_of(NOT_A_COUNT, st.none()),
    "rng": st.one_of(st.none(), NUMBER, TEXT, st.lists(st.integers(0, 2**32 - 1), max_size=5).filter(lambda v: len(v) != 2),
                     st.lists(st.one_of(st.integers(-10**6, -1), st.integers(2**32, 2**40), TEXT), min_size=2, max_size=2)),
    "best_val": st.one_of(TEXT, st.booleans(), st.lists(st.integers(), max_size=2)),
    "best_step": NOT_A_COUNT,
}


@st.composite
def resume_damage(draw):
    """(file, how) for the resumed checkpoint; `how(path)` damages the file at `path`."""
    file = draw(st.sampled_from(CHECKPOINT_FILES))
    kind = draw(st.sampled_from(["missing", "empty", "truncated", "garbage", "foreign"]))
    if kind == "missing":
        return file, lambda p: p.unlink()
    if kind == "empty":
        return file, lambda p: p.write_bytes(b"")
    if kind == "truncated":
        frac = draw(st.floats(0, 1, exclude_max=True))
        return file, lambda p: p.write_bytes(p.read_bytes()[: int(frac * p.stat().st_size)])
    if kind == "garbage":
        data = draw(st.binary(min_size=1, max_size=64).filter(lambda b: not _json_object(b)))
        return file, lambda p: p.write_bytes(data)
    if file == "trainer_state.json":  # a JSON object without a field it needs, or with a bad one
        key = draw(st.sampled_from(STATE_KEYS))
        if draw(st.booleans()):
            return file, lambda p: p.write_text(json.dumps({k: v for k, v in json.loads(p.read_text()).items()
                                                            if k != key}))
        value = draw(BAD_STATE_VALUES[key] | (st.integers(0, 50).filter(lambda v: v != 2) if key == "step"
                                              else st.nothing()))
        return file, lambda p: p.write_text(json.dumps(dict(json.loads(p.read_text()), **{key: value})))
    # tensors that do not fit: one renamed, dropped, added, or of another shape
    change = draw(st.sampled_from(["rename", "drop", "add", "shape"]))
    pick = draw(st.integers(0, 10**6))

    def foreign(p):
        import mlx.core as mx

        tensors = dict(mx.load(str(p)))
        name = sorted(tensors)[pick % len(tensors)]
        if change == "rename":
            tensors[name + ".x"] = tensors.pop(name)
        elif change == "drop":
            tensors.pop(name)
        elif change == "add":
            tensors["model.extra"] = mx.zeros((2,))
        else:
            tensors[name] = mx.zeros((tensors[name].size + 1,))
        mx.save_safetensors(str(p), tensors)

    return file, foreign


def _json_object(data):
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


def test_resume_from_damaged_checkpoints(env, request, tmp_path_factory):
    """Each damage of the resumed checkpoint: one line naming the file, exit 2, the run as it was."""
    tmp, model_dir, data_dir, finished = env
    work = tmp_path_factory.mktemp("resume") / "run"

    def check(case):
        file, damage = case
        if work.exists():
            shutil.rmtree(work)
        shutil.copytree(finished, work, symlinks=True)  # files of their own: the damage stays in the checkpoint
        path = work / "checkpoints" / "step-0000002" / file
        damage(path)
        before = snapshot(work)
        rc, err = in_process(["train", "--resume", work, "--iters", "4"])
        assert_one_line_error(rc, err, "resume: ", str(path))
        assert snapshot(work) == before

    run_property(request, "resume", resume_damage(), check)
