"""Job files and job dicts: every rejection, defaults, the wire round trip, the examples."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from conftest import edited, one_line_error
from helpers import example_files

from hetpipe.job import (
    DataSpec,
    JobError,
    JobSpec,
    ModelSpec,
    OptimizerSpec,
    VWSpec,
    load_job,
)

ROOT = Path(__file__).resolve().parent.parent

BASE = """\
name = "t"

[model]
name = "cnn"
args = { width = 8 }

[data]
name = "digits"

[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9

[train]
minibatch = 16
nm = 2
epochs = 3
staleness = 1

[[vw]]
devices = ["gpu0", "gpu1"]
layers = [3, 2]

[[vw]]
devices = ["gpu2"]
nm = 1
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def edit(old: str, new: str) -> str:
    """BASE with one exact edit (``old == ""`` appends ``new``)."""
    return edited(BASE, old, new)


def rejected(path: Path, key: str, problem: str) -> str:
    """Load must fail with ONE line naming the file, the key and the problem."""
    return one_line_error(load_job, JobError, path, key, problem)


# (id, old, new, key, problem)
CASES = [
    (
        "toml-syntax",
        "minibatch = 16",
        "minibatch = [16",
        "line 17, column 1",
        "invalid TOML: Unclosed array",
    ),
    ("missing-name", 'name = "t"\n', "", "name", "missing required key"),
    ("empty-name", 'name = "t"', 'name = ""', "name", "must not be empty"),
    (
        "missing-model",
        '[model]\nname = "cnn"\nargs = { width = 8 }\n',
        "",
        "model.name",
        "missing required key",
    ),
    ("missing-model-name", 'name = "cnn"\n', "", "model.name", "missing required key"),
    ("missing-minibatch", "minibatch = 16\n", "", "train.minibatch", "missing required key"),
    ("no-epochs", "epochs = 3\n", "", "train.epochs", "exactly one of epochs / minibatches"),
    (
        "both-epochs",
        "epochs = 3",
        "epochs = 3\nminibatches = 10",
        "train.minibatches",
        "exactly one of epochs / minibatches, not both",
    ),
    ("epochs-zero", "epochs = 3", "epochs = 0", "train.epochs", "must be >= 1, got 0"),
    ("minibatches-negative", "epochs = 3", "minibatches = -4", "train.minibatches", "must be >= 1"),
    ("nm-zero", "nm = 2", "nm = 0", "train.nm", "must be >= 1, got 0"),
    ("staleness-negative", "staleness = 1", "staleness = -1", "train.staleness", "must be >= 0"),
    ("minibatch-zero", "minibatch = 16", "minibatch = 0", "train.minibatch", "must be >= 1"),
    ("seed-negative", "staleness = 1", "staleness = 1\nseed = -3", "train.seed", "must be >= 0"),
    (
        "optimizer-name",
        'name = "sgd"',
        'name = "rmsprop"',
        "optimizer.name",
        "unknown optimizer 'rmsprop' (one of: sgd, adam, adamw)",
    ),
    ("lr-zero", "lr = 0.1", "lr = 0", "optimizer.lr", "must be > 0"),
    ("lr-negative", "lr = 0.1", "lr = -0.1", "optimizer.lr", "must be > 0"),
    ("momentum-one", "momentum = 0.9", "momentum = 1.0", "optimizer.momentum", "must be in [0, 1)"),
    ("momentum-negative", "momentum = 0.9", "momentum = -0.1", "optimizer.momentum", "[0, 1)"),
    (
        "weight-decay",
        "momentum = 0.9",
        "momentum = 0.9\nweight_decay = -1e-4",
        "optimizer.weight_decay",
        "must be >= 0",
    ),
    (
        "betas-range",
        "momentum = 0.9",
        "momentum = 0.9\nbetas = [0.9, 1.0]",
        "optimizer.betas[1]",
        "must be in [0, 1)",
    ),
    (
        "betas-length",
        "momentum = 0.9",
        "momentum = 0.9\nbetas = [0.9]",
        "optimizer.betas",
        "expected 2 numbers",
    ),
    ("eps-zero", "momentum = 0.9", "momentum = 0.9\neps = 0", "optimizer.eps", "must be > 0"),
    (
        "nesterov-no-momentum",
        "momentum = 0.9",
        "nesterov = true",
        "optimizer.nesterov",
        "needs momentum > 0",
    ),
    (
        "vw-empty-devices",
        'devices = ["gpu2"]',
        "devices = []",
        "vw[1].devices",
        "at least one device",
    ),
    ("vw-missing-devices", 'devices = ["gpu2"]\n', "", "vw[1].devices", "missing required key"),
    (
        "vw-duplicate-device",
        '["gpu0", "gpu1"]',
        '["gpu0", "gpu0"]',
        "vw[0].devices[1]",
        "duplicate device 'gpu0'",
    ),
    (
        "vw-layers-length",
        "layers = [3, 2]",
        "layers = [3, 2, 1]",
        "vw[0].layers",
        "3 entries for 2 devices",
    ),
    ("vw-layers-zero", "layers = [3, 2]", "layers = [3, 0]", "vw[0].layers[1]", "must be >= 1"),
    (
        "vw-shared-device",
        'devices = ["gpu2"]',
        'devices = ["gpu1"]',
        "vw[1].devices[0]",
        "device 'gpu1' is already in vw[0]",
    ),
    ("vw-nm-zero", "nm = 1", "nm = 0", "vw[1].nm", "must be >= 1"),
    (
        "policy",
        "staleness = 1",
        'staleness = 1\npolicy = "best"',
        "train.policy",
        "unknown policy 'best' (one of: auto, np, ed, hd)",
    ),
    ("vws-zero", "staleness = 1", "staleness = 1\nvws = 0", "train.vws", "must be >= 1"),
    (
        "vws-mismatch",
        "staleness = 1",
        "staleness = 1\nvws = 3",
        "train.vws",
        "is 3 but 2 [[vw]] tables",
    ),
    (
        "unknown-top",
        'name = "t"',
        'name = "t"\nowner = "me"',
        "owner",
        "unknown key (allowed: code, data, fault, loss_scale, lr_schedule, model, name, "
        "optimizer, replan, sources, train, vw)",
    ),
    (
        "unknown-model",
        'name = "cnn"',
        'name = "cnn"\nwidth = 8',
        "model.width",
        "unknown key (allowed: args, loss, name, split_points)",
    ),
    ("unknown-data", 'name = "digits"', 'name = "digits"\nsplit = 1', "data.split", "unknown key"),
    ("unknown-optimizer", "lr = 0.1", "lr = 0.1\nbeta = 0.9", "optimizer.beta", "unknown key"),
    ("unknown-train", "nm = 2", "nm = 2\nwaves = 2", "train.waves", "unknown key"),
    (
        "unknown-vw",
        "layers = [3, 2]",
        "layers = [3, 2]\nspeed = 1",
        "vw[0].speed",
        "unknown key (allowed: devices, layers, nm)",
    ),
    (
        "type-minibatch",
        "minibatch = 16",
        'minibatch = "16"',
        "train.minibatch",
        "expected an integer, got string",
    ),
    (
        "type-staleness-float",
        "staleness = 1",
        "staleness = 1.5",
        "train.staleness",
        "expected an integer, got float",
    ),
    ("type-nm-bool", "nm = 2", "nm = true", "train.nm", "expected an integer, got boolean"),
    ("type-lr-bool", "lr = 0.1", "lr = true", "optimizer.lr", "expected a number, got boolean"),
    ("type-devices", '["gpu2"]', '"gpu2"', "vw[1].devices", "expected an array"),
    ("type-device-item", '["gpu2"]', "[2]", "vw[1].devices[0]", "expected a string"),
    (
        "type-model",
        '[model]\nname = "cnn"\nargs = { width = 8 }\n',
        'model = "cnn"\n',
        "model",
        "expected a table, got string",
    ),
    ("type-args", "args = { width = 8 }", "args = 8", "model.args", "expected a table"),
    (
        "args-datetime",
        "args = { width = 8 }",
        "args = { at = 2024-01-01 }",
        "model.args.at",
        "unsupported value type date/time",
    ),
    (
        "epochs-64-bit",
        "epochs = 3",
        "epochs = 99999999999999999999",
        "train.epochs",
        "out of range (must fit in 64 bits)",
    ),
    ("epochs-huge", "epochs = 3", "epochs = 99999999999", "train.epochs", "must be <= 1048576"),
    (
        "minibatch-huge",
        "minibatch = 16",
        "minibatch = 999999999",
        "train.minibatch",
        "must be <= 16777216",
    ),
    (
        "hang-tiny",
        "staleness = 1",
        "staleness = 1\nhang_after_s = 0.001",
        "train.hang_after_s",
        "must be >= 1",
    ),
    (
        "weights-unknown",
        "staleness = 1",
        'staleness = 1\nweights = "guess"',
        "train.weights",
        "unknown mode 'guess' (one of: stash, latest, predict)",
    ),
    (
        "weights-sync",
        "staleness = 1",
        'staleness = 1\nweights = "predict"\nschedule = "1f1b"',
        "train.weights",
        "'predict' needs the async schedule (in 1f1b nothing is stale)",
    ),
    (
        "predict-plain-sgd",
        "momentum = 0.9\n\n[train]\n",
        'momentum = 0.0\n\n[train]\nweights = "predict"\n',
        "train.weights",
        "predict cannot extrapolate plain sgd (no momentum to follow): set optimizer.momentum > 0 "
        "or use adam",
    ),
    (
        "predict-variant",
        "staleness = 1",
        'staleness = 1\npredict_variant = "future"',
        "train.predict_variant",
        "unknown variant 'future' (one of: paper, consistent)",
    ),
    (
        "bn-negative",
        "staleness = 1",
        "staleness = 1\nbn_recalibrate = -1",
        "train.bn_recalibrate",
        "must be >= 0",
    ),
    (
        "warmup-gpipe",
        "staleness = 1",
        'staleness = 1\nschedule = "gpipe"\nwarmup_forwards = 2',
        "train.warmup_forwards",
        "extra warm-up forwards are for the 1f1b order; schedule 'gpipe' has none",
    ),
    (
        "warmup-auto-async",
        "staleness = 1",
        'staleness = 1\nwarmup_forwards = "auto"',
        "train.warmup_forwards",
        "auto picks 1f1b's warm-up; schedule 'async' has none",
    ),
    (
        "warmup-negative",
        "staleness = 1",
        'staleness = 1\nschedule = "1f1b"\nwarmup_forwards = -1',
        "train.warmup_forwards",
        "must be in 0..65536, got -1",
    ),
    (
        "warmup-text",
        "staleness = 1",
        'staleness = 1\nschedule = "1f1b"\nwarmup_forwards = "lots"',
        "train.warmup_forwards",
        "must be an integer >= 0 or \"auto\", got 'lots'",
    ),
    (
        "in-flight",
        "staleness = 1",
        'staleness = 1\nin_flight = "all"',
        "train.in_flight",
        "unknown bound 'all' (one of: plan, nm)",
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "key", "problem"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rejects(tmp_path: Path, old: str, new: str, key: str, problem: str) -> None:
    rejected(write(tmp_path, edit(old, new)), key, problem)


def test_missing_file(tmp_path: Path) -> None:
    rejected(tmp_path / "nope.toml", "file", "cannot read")


def test_base_loads(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, BASE))
    assert job.name == "t"
    assert job.model == ModelSpec("cnn", {"width": 8})
    assert job.data == DataSpec("digits")
    assert job.optimizer == OptimizerSpec(lr=0.1, momentum=0.9)
    assert (job.minibatch, job.nm, job.staleness, job.epochs, job.minibatches) == (
        16,
        2,
        1,
        3,
        None,
    )
    assert job.vws == (VWSpec(("gpu0", "gpu1"), (3, 2)), VWSpec(("gpu2",), None, 1))
    assert (job.num_vws, job.policy, job.seed) == (None, "auto", 0)


def test_defaults() -> None:
    job = JobSpec.from_dict(
        {"name": "d", "model": {"name": "mlp"}, "train": {"minibatch": 4, "minibatches": 9}}
    )
    assert (job.nm, job.staleness, job.seed, job.policy) == (None, 0, 0, "auto")
    assert job.optimizer == OptimizerSpec() and job.optimizer.name == "sgd"
    assert job.optimizer.lr == 0.05
    assert job.vws == () and job.num_vws is None and job.epochs is None
    assert job.model.args == {} and job.data.args == {}


@pytest.mark.parametrize(
    ("optimizer", "weight_decay"),
    [
        ({"name": "adamw"}, 0.01),
        ({"name": "adamw", "weight_decay": 0.0}, 0.0),
        ({"name": "adam"}, 0.0),
        ({"name": "sgd", "momentum": 0.9, "nesterov": True}, 0.0),
    ],
)
def test_optimizer_defaults(optimizer: dict, weight_decay: float) -> None:
    """AdamW's decay defaults to torch's 0.01; the others' to 0; nesterov is accepted."""
    job = JobSpec.from_dict(
        {
            "name": "d",
            "model": {"name": "mlp"},
            "optimizer": optimizer,
            "train": {"minibatch": 4, "minibatches": 9},
        }
    )
    assert job.optimizer.name == optimizer["name"]
    assert job.optimizer.weight_decay == weight_decay
    assert job.optimizer.nesterov == optimizer.get("nesterov", False)
    assert JobSpec.from_dict(job.to_dict()) == job


def test_free_form_args(tmp_path: Path) -> None:
    text = edit("args = { width = 8 }", 'args = { anything = [1, "two", { three = 3.0 }] }')
    job = load_job(write(tmp_path, text + "\n[data.args]\nn = 100\nnoise = 0.5\n"))
    assert job.model.args == {"anything": [1, "two", {"three": 3.0}]}
    assert job.data.args == {"n": 100, "noise": 0.5}


def full_job() -> JobSpec:
    return JobSpec(
        name="full",
        model=ModelSpec("pkg.models:build", {"width": 16, "dims": [1, 2], "opts": {"a": None}}),
        data=DataSpec("synthetic", {"n": 64}),
        optimizer=OptimizerSpec("adam", 1e-3, 0.0, 1e-5, False, (0.8, 0.99), 1e-6),
        minibatch=8,
        nm=3,
        staleness=2,
        epochs=None,
        minibatches=100,
        seed=7,
        vws=(VWSpec(("gpu0", "gpu1"), (2, 3), 2), VWSpec(("gpu2",), None, None)),
        num_vws=2,
        policy="hd",
    )


def test_in_flight_is_plan_by_default_and_round_trips() -> None:
    def spec(**train: object) -> JobSpec:
        return JobSpec.from_dict(
            {
                "name": "f",
                "model": {"name": "mlp"},
                "train": {"minibatch": 4, "minibatches": 9, **train},
            }
        )

    assert spec().in_flight == "plan"
    for s in (spec(), spec(in_flight="nm")):
        assert JobSpec.from_dict(s.to_dict()) == s
    assert spec(in_flight="nm").in_flight == "nm"


def test_warmup_is_an_integer_or_auto_and_auto_by_default_with_schedule_auto() -> None:
    def spec(**train: object) -> JobSpec:
        return JobSpec.from_dict(
            {
                "name": "w",
                "model": {"name": "mlp"},
                "train": {"minibatch": 4, "minibatches": 9, **train},
            }
        )

    assert spec(schedule="1f1b").warmup_forwards == 0
    assert spec(schedule="1f1b", warmup_forwards=3).warmup_forwards == 3
    assert spec(schedule="1f1b", warmup_forwards="auto").warmup_forwards is None
    assert spec(schedule="auto").warmup_forwards is None
    assert spec(schedule="auto", warmup_forwards=1).warmup_forwards == 1
    assert spec().warmup_forwards == 0
    for s in (
        spec(schedule="1f1b", warmup_forwards="auto"),
        spec(schedule="1f1b", warmup_forwards=2),
    ):
        assert JobSpec.from_dict(s.to_dict()) == s


def test_round_trip() -> None:
    job = full_job()
    assert JobSpec.from_dict(job.to_dict()) == job


def test_round_trip_over_msgpack(tmp_path: Path) -> None:
    for job in (full_job(), load_job(write(tmp_path, BASE))):
        wire = msgpack.unpackb(msgpack.packb(job.to_dict()))
        assert JobSpec.from_dict(wire) == job


def test_to_dict_is_plain() -> None:
    def plain(value: object) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, str | int | float | bool)

    d = full_job().to_dict()
    assert plain(d)
    d["model"]["args"]["dims"].append(3)  # a copy: the spec is untouched
    assert full_job().model.args["dims"] == [1, 2]


def test_from_dict_errors_name_the_source() -> None:
    d = full_job().to_dict()
    d["train"]["nm"] = 0
    with pytest.raises(JobError, match=r"^<job>: train\.nm: must be >= 1, got 0$"):
        JobSpec.from_dict(d)
    with pytest.raises(JobError, match=r"^head: \(document\): expected a table, got array$"):
        JobSpec.from_dict([], source="head")  # type: ignore[arg-type]


def test_from_dict_none_is_absent() -> None:
    d = full_job().to_dict()
    d["train"]["epochs"] = None  # a peer may send explicit nulls for absent optionals
    assert JobSpec.from_dict(d) == full_job()


def test_examples() -> None:
    cnn = load_job(ROOT / "examples" / "digits_cnn.toml")
    assert cnn.model.name == "cnn" and cnn.data.name == "digits"
    assert (cnn.minibatch, cnn.nm, cnn.epochs) == (32, 4, 15)
    assert cnn.optimizer == OptimizerSpec("sgd", 0.05, 0.9, 1e-4)
    assert cnn.vws == (VWSpec(("gpu0", "gpu1", "gpu2", "gpu3"), (4, 4, 4, 4)),)
    assert (cnn.weights, cnn.predict_variant, cnn.bn_recalibrate) == ("stash", "paper", 0)
    predict = load_job(ROOT / "examples" / "digits_predict.toml")
    assert (predict.weights, predict.predict_variant, predict.bn_recalibrate) == (
        "predict",
        "paper",
        16,
    )
    assert JobSpec.from_dict(predict.to_dict()) == predict  # the new keys travel
    mlp = load_job(ROOT / "examples" / "digits_mlp.toml")
    assert mlp.model.name == "mlp" and mlp.epochs == 10
    assert mlp.vws == (VWSpec(("gpu0", "gpu1"), (3, 3)),)


def test_example_splits_cover_their_models() -> None:
    from hetpipe.models import build_model

    for name in ("digits_cnn", "digits_mlp"):
        job = load_job(ROOT / "examples" / f"{name}.toml")
        model = build_model(job.model.name, job.model.args)
        for vw in job.vws:
            assert vw.layers is not None and sum(vw.layers) == len(model), name


REPLAN = (
    'the planner\'s {} applies only without one, or on a re-plan under on_worker_loss = "replan"'
)

# (id, old, new, the one line after "<file>: "): a key set where it has no effect
NO_EFFECT = [
    (
        "staleness-gpipe",
        "staleness = 1",
        'staleness = 1\nschedule = "gpipe"',
        "train.staleness: has no effect with schedule 'gpipe' (synchronous)",
    ),
    (
        "staleness-1f1b",
        "staleness = 1",
        'staleness = 1\nschedule = "1f1b"',
        "train.staleness: has no effect with schedule '1f1b' (synchronous)",
    ),
    (
        "momentum-adam",
        'name = "sgd"',
        'name = "adam"',
        "optimizer.momentum: has no effect with optimizer 'adam' (momentum is sgd's)",
    ),
    (
        "momentum-adamw",
        'name = "sgd"',
        'name = "adamw"',
        "optimizer.momentum: has no effect with optimizer 'adamw' (momentum is sgd's)",
    ),
    (
        "nesterov-adam",
        'name = "sgd"\nlr = 0.1\nmomentum = 0.9',
        'name = "adam"\nlr = 0.1\nnesterov = false',
        "optimizer.nesterov: has no effect with optimizer 'adam' (Nesterov momentum is sgd's)",
    ),
    (
        "betas-sgd",
        "momentum = 0.9",
        "momentum = 0.9\nbetas = [0.8, 0.9]",
        "optimizer.betas: has no effect with optimizer 'sgd' (betas are adam's)",
    ),
    (
        "eps-sgd",
        "momentum = 0.9",
        "momentum = 0.9\neps = 1e-6",
        "optimizer.eps: has no effect with optimizer 'sgd' (eps is adam's)",
    ),
    (
        "predict-variant-stash",
        "staleness = 1",
        'staleness = 1\npredict_variant = "consistent"',
        "train.predict_variant: has no effect with weights 'stash' "
        '(it only tunes weights = "predict")',
    ),
    (
        "predict-variant-latest",
        "staleness = 1",
        'staleness = 1\nweights = "latest"\npredict_variant = "paper"',
        "train.predict_variant: has no effect with weights 'latest' "
        '(it only tunes weights = "predict")',
    ),
    (
        "policy-with-vw",
        "staleness = 1",
        'staleness = 1\npolicy = "hd"',
        "train.policy: has no effect with [[vw]] tables (the job gives its own split; "
        + REPLAN.format("policy")
        + ")",
    ),
    (
        "in-flight-with-vw",
        "staleness = 1",
        'staleness = 1\nin_flight = "nm"',
        "train.in_flight: has no effect with [[vw]] tables (the job gives its own split; "
        + REPLAN.format("bound")
        + ")",
    ),
    (
        "weights-gpipe",
        "staleness = 1",
        'schedule = "gpipe"\nweights = "stash"',
        "train.weights: has no effect with schedule 'gpipe' (synchronous)",
    ),
    (
        "warmup-async",
        "staleness = 1",
        "staleness = 1\nwarmup_forwards = 0",
        "train.warmup_forwards: has no effect with schedule 'async' (warm-up forwards are 1f1b's)",
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "line"), [c[1:] for c in NO_EFFECT], ids=[c[0] for c in NO_EFFECT]
)
def test_refuses_a_key_set_where_it_has_no_effect(
    tmp_path: Path, old: str, new: str, line: str
) -> None:
    path = write(tmp_path, edit(old, new))
    with pytest.raises(JobError) as info:
        load_job(path)
    assert str(info.value) == f"{path}: {line}"


def test_a_key_set_where_it_has_an_effect_loads(tmp_path: Path) -> None:
    # a re-plan (on_worker_loss = "replan") forms virtual workers under the policy
    replan = 'staleness = 1\npolicy = "hd"\nin_flight = "nm"\non_worker_loss = "replan"'
    job = load_job(write(tmp_path, edit("staleness = 1", replan)))
    assert (job.policy, job.in_flight, len(job.vws)) == ("hd", "nm", 2)
    adam = 'name = "adam"\nlr = 0.1\nbetas = [0.8, 0.9]\neps = 1e-6'
    job = load_job(write(tmp_path, edit('name = "sgd"\nlr = 0.1\nmomentum = 0.9', adam)))
    assert (job.optimizer.betas, job.optimizer.eps) == ((0.8, 0.9), 1e-6)
    auto = {"name": "a", "model": {"name": "mlp"}}
    auto["train"] = {"minibatch": 4, "minibatches": 9, "schedule": "auto", "staleness": 2}
    assert JobSpec.from_dict(auto, strict=True).staleness == 2


def test_a_dict_from_the_wire_may_carry_a_key_without_effect() -> None:
    """Only what a user wrote is refused (``load_job``, ``strict=True``): a job made in code
    travels as it is."""
    d = full_job().to_dict()  # policy "hd" beside [[vw]] tables
    assert JobSpec.from_dict(d) == full_job()
    with pytest.raises(JobError, match=r"^<job>: train\.policy: has no effect with \[\[vw\]\]"):
        JobSpec.from_dict(d, strict=True)


def test_to_dict_leaves_out_defaults_without_effect() -> None:
    """A loaded job's dict passes the strict load again: keys without effect that hold their
    default are not written (absent, they read as that default)."""
    for path in example_files()[0]:
        job = load_job(path)
        assert JobSpec.from_dict(job.to_dict(), strict=True) == job, path
    d = full_job().to_dict()
    assert "momentum" not in d["optimizer"] and "nesterov" not in d["optimizer"]  # adam's
    assert d["optimizer"]["betas"] == [0.8, 0.99]
    assert "in_flight" not in d["train"] and d["train"]["policy"] == "hd"  # not the default
