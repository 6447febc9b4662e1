"""``msdist plan --model`` and ``msdist suggest`` through typer's CliRunner."""

import json

import pytest
from typer.testing import CliRunner

from mindscience.distributed.costmodel import estimate, load_workload, violations
from mindscience.distributed.costmodel.search import size_choices
from mindscience.distributed.topology import Layout, load_layout
from mscli.layouts import bundled_layouts, bundled_models, load
from mscli.main import app
from test_cli_plan import assert_bad_input, write

runner = CliRunner()
STAGE_KEYS = {"stage", "layers", "parameters", "weights_bytes", "gradients_bytes", "optimizer_bytes",
              "activations_bytes", "communicator_bytes", "total_bytes"}
STEP_KEYS = {"group", "op", "bytes", "count", "crosses_nodes", "est_time_s"}
CANDIDATE_KEYS = {"tp", "cp", "dp", "pp", "order", "peak_bytes", "fits", "est_time_s", "bottleneck",
                  "step_time_s", "breakdown", "tokens_per_s", "mfu", "micro_batch_size", "pipeline_bubble"}
SMALL_MODEL = """\
model:
  num_layers: 4
  hidden_size: 256
  num_attention_heads: 8
  seq_length: 512
  vocab_size: 1024
"""


def invoke(*args, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


# ------------------------------------------------------------------ presets
def test_presets_are_bundled_and_not_listed_as_layouts():
    assert {"gpt3-175b", "gqa-7b", "sci-transformer-s"} <= set(bundled_models())
    assert not set(bundled_models()) & set(bundled_layouts())
    gqa = load_workload(bundled_models()["gqa-7b"]).model
    assert gqa.num_query_groups < gqa.num_attention_heads
    assert load_workload(bundled_models()["gpt3-175b"]).training.recompute == "selective"


# ------------------------------------------------------------------ plan --model
def test_plan_model_json_keys_and_values():
    result = invoke("plan", "ascend-64", "--model", "gqa-7b", "--format", "json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["world_size"] == 64 and "groups" in data  # the plan is unchanged
    memory, comm = data["memory"], data["communication"]
    assert set(memory) >= {"stages", "peak_bytes", "device_memory_bytes", "fits"}
    assert len(memory["stages"]) == 2 and all(STAGE_KEYS <= set(s) for s in memory["stages"])
    assert memory["peak_bytes"] == max(s["total_bytes"] for s in memory["stages"])
    assert memory["device_memory_bytes"] == 64 * 1024**3 and memory["fits"] is True
    assert all(s["communicator_bytes"] == data["communicators"]["buffer_mb_per_rank"] * 1024**2
               for s in memory["stages"])
    assert set(comm) >= {"per_step", "est_time_s", "bottleneck"}
    assert all(STEP_KEYS <= set(r) for r in comm["per_step"])
    groups = {r["group"] for r in comm["per_step"]}
    assert groups == {"tp", "cp", "pp", "dp-cp"}
    crossing = {r["group"]: r["crosses_nodes"] for r in comm["per_step"]}
    # ascend-64 keeps tp and cp inside a node; pp and dp-cp cross (as the plan marks them).
    assert crossing == {"tp": False, "cp": False, "pp": True, "dp-cp": True}
    assert all(bool(data["cross_node"][k]) == v for k, v in crossing.items())
    assert comm["est_time_s"] == pytest.approx(sum(r["est_time_s"] for r in comm["per_step"]))


def test_plan_model_tables_in_human_view_and_svg(tmp_path):
    svg = tmp_path / "plan.svg"
    # --svg-table saves the terminal tables (--svg draws the device grid, tests/test_pictures.py).
    result = invoke("plan", "ascend-64", "-m", "gpt3-175b", "--svg-table", svg)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "memory per rank: gpt3-175b" in out and "does NOT fit" in out
    assert "communication per step" in out and "bottleneck: tp" in out
    assert "step time (busiest stage)" in out and "tokens/s, MFU" in out
    text = svg.read_text()
    assert "memory" in text and "communication" in text and "bottleneck" in text


def test_plan_virtual_stages_prices_the_schedule_it_draws(tmp_path):
    from dataclasses import replace

    base = json.loads(invoke("plan", "ascend-64", "-m", "gqa-7b", "--format", "json").stdout)
    result = invoke("plan", "ascend-64", "-m", "gqa-7b", "--schedule", "interleaved", "--virtual-stages", 2,
                    "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schedule"]["virtual_stages"] == 2 and data["model"]["training"]["virtual_pipeline_stages"] == 2
    # The step time is that of the model trained with training.virtual_pipeline_stages: 2 ...
    workload = load_workload(bundled_models()["gqa-7b"])
    two = replace(workload, training=replace(workload.training, virtual_pipeline_stages=2))
    expected = estimate(load_layout(bundled_layouts()["ascend-64"]), two)
    assert data["time"]["step_time_s"] == pytest.approx(expected["time"]["step_time_s"])
    # ... whose bubble (p-1)/(v*m) is half that of v = 1: 1/128 -> 1/256 of the compute with m = 128.
    assert base["model"]["pipeline_bubble"] == pytest.approx(1 / 128)
    assert data["model"]["pipeline_bubble"] == pytest.approx(1 / 256)
    assert data["time"]["breakdown"]["bubble_s"] == pytest.approx(base["time"]["breakdown"]["bubble_s"] / 2)
    # With a model, --virtual-stages prices the step without drawing a schedule.
    alone = json.loads(invoke("plan", "ascend-64", "-m", "gqa-7b", "--virtual-stages", 2, "--format", "json").stdout)
    assert "schedule" not in alone and alone["time"]["step_time_s"] == data["time"]["step_time_s"]
    # A model file that asks for 2 chunks: --schedule interleaved draws 2 without the option.
    model = tmp_path / "v2.yaml"
    model.write_text(bundled_models()["gqa-7b"].read_text() + "  virtual_pipeline_stages: 2\n")
    drawn = json.loads(invoke("plan", "ascend-64", "-m", model, "--schedule", "interleaved", "--format",
                              "json").stdout)
    assert drawn["schedule"]["virtual_stages"] == 2 and drawn["model"]["training"]["virtual_pipeline_stages"] == 2
    # --virtual-stages 1 overrides the file: the plain 1F1B bubble again.
    one = json.loads(invoke("plan", "ascend-64", "-m", model, "--virtual-stages", 1, "--format", "json").stdout)
    assert one["model"]["pipeline_bubble"] == pytest.approx(1 / 128)


@pytest.mark.parametrize("args,fragment", [
    (("--virtual-stages", 2), "--microbatches and --virtual-stages describe a schedule"),
    (("--virtual-stages", 0, "-m", "gqa-7b"), "--virtual-stages 0 is invalid"),
    (("--virtual-stages", 3, "-m", "gqa-7b"), "num_layers % (pp*virtual_pipeline_stages) fails"),
])
def test_plan_virtual_stages_errors(args, fragment):
    assert_bad_input(invoke("plan", "ascend-64", *args), fragment)


def test_layout_file_with_model_section_and_override(tmp_path):
    layout = write(tmp_path, "world_size: 8\ntp: 2\npp: 2\ncluster:\n  device_memory_gb: 1\n" + SMALL_MODEL,
                   "layout.yaml")
    data = json.loads(invoke("plan", layout, "--format", "json").stdout)
    assert data["model"]["parameters"] == 4 * (12 * 256**2 + 13 * 256) + (1024 + 512) * 256 + 2 * 256
    assert data["memory"]["device_memory_bytes"] == 1024**3
    # --model replaces the model; the layout's cluster section stays.
    data = json.loads(invoke("plan", layout, "--model", "sci-transformer-s", "--format", "json").stdout)
    assert data["model"]["name"] == "sci-transformer-s" and data["memory"]["fits"] is False
    # Without a model section there is no estimate.
    assert "memory" not in json.loads(invoke("plan", "cpu-4", "--format", "json").stdout)


def test_plan_rank_view_with_model():
    result = invoke("plan", "cpu-8-pp2", "--rank", "5", "-m", "sci-transformer-s")
    assert result.exit_code == 0, result.output
    assert "rank 5" in result.stdout and "memory per rank" in result.stdout


@pytest.mark.parametrize(
    "layout,model,fragments",
    [
        ("world_size: 8\ntp: 8\n", SMALL_MODEL.replace("num_attention_heads: 8", "num_attention_heads: 4"),
         ["num_attention_heads % tp fails", "num_attention_heads=4", "tp=8", "Use a tp that divides 4"]),
        ("world_size: 8\npp: 8\n", SMALL_MODEL, ["num_layers % pp fails", "Use a pp that divides 4"]),
        ("world_size: 8\ntp: 2\ncp: 4\n", SMALL_MODEL.replace("num_attention_heads: 8", "num_attention_heads: 2")
         + "training:\n  context_parallel_method: ulysses\n", ["(num_attention_heads / tp) % cp fails", "Ulysses"]),
        ("world_size: 8\ntp: 4\n", SMALL_MODEL + "  num_query_groups: 2\n", ["num_query_groups % tp fails"]),
        ("world_size: 8\ntp: 8\n", SMALL_MODEL.replace("seq_length: 512", "seq_length: 12"),
         ["seq_length % (tp*cp) fails", "sequence_parallel: false"]),
        ("world_size: 8\ntp: 2\n", SMALL_MODEL + "training:\n  global_batch_size: 3\n",
         ["global_batch_size % (micro_batch_size*dp) fails", "multiple of 4"]),
    ],
)
def test_plan_constraint_errors_exit_2_one_line(tmp_path, layout, model, fragments):
    layout_path = write(tmp_path, layout, "layout.yaml")
    model_path = write(tmp_path, model, "model.yaml")
    assert_bad_input(invoke("plan", layout_path, "--model", model_path), model_path, *fragments)
    assert_bad_input(invoke("plan", layout_path, "--model", model_path, "--format", "json"), *fragments)


@pytest.mark.parametrize(
    "text,fragments",
    [
        (SMALL_MODEL + "  foo: 1\n", ["unknown key 'model.foo'", "num_layers"]),
        (SMALL_MODEL.replace("num_layers: 4", "num_layers: four"), ["key 'model.num_layers'", "expected an integer"]),
        (SMALL_MODEL.replace("  vocab_size: 1024\n", ""), ["'model.vocab_size' is missing"]),
        (SMALL_MODEL.replace("hidden_size: 256", "hidden_size: 250"), ["model.hidden_size=250 is not divisible"]),
        (SMALL_MODEL + "  num_query_groups: 3\n", ["model.num_query_groups=3 does not divide"]),
        (SMALL_MODEL + "training:\n  precision: fp8\n", ["training.precision='fp8'", "bf16, fp16, fp32"]),
        (SMALL_MODEL + "training:\n  recompute: yes\n", ["key 'training.recompute'"]),
        (SMALL_MODEL + "training:\n  sequence_parallel: 1\n", ["key 'training.sequence_parallel'", "true or false"]),
        (SMALL_MODEL + "cluster:\n  device_memory_gb: 0\n", ["cluster.device_memory_gb=0 is invalid"]),
        (SMALL_MODEL + "cluster: 64\n", ["section 'cluster'", "expected a mapping"]),
        (SMALL_MODEL + "modle: {}\n", ["unknown key 'modle'"]),
        ("training:\n  micro_batch_size: 2\n", ["no 'model' section"]),
        ("model: [1\n", ["malformed YAML"]),
        ("", ["empty", "'model' section"]),
    ],
)
def test_model_file_errors_name_file_and_key(tmp_path, text, fragments):
    path = write(tmp_path, text, "model.yaml")
    assert_bad_input(invoke("plan", "cpu-4", "--model", path), path, *fragments)
    assert_bad_input(invoke("suggest", "--model", path, "--world", "8"), path, *fragments)


def test_bad_section_in_layout_file_is_a_layout_error(tmp_path):
    path = write(tmp_path, "world_size: 4\nmodel: 3\n", "layout.yaml")
    assert_bad_input(invoke("plan", path), path, "section 'model'", "expected a mapping")


def test_unknown_model_preset():
    assert_bad_input(invoke("plan", "cpu-4", "--model", "gpt5"), "gpt5", "gpt3-175b", "gqa-7b")


# ------------------------------------------------------------------ suggest
def check_candidates(data, workload, world, per_node):
    """Every candidate is a valid layout that fits, agrees with plan's estimate, best first."""
    model, training = workload.model, workload.training
    assert data["candidates"], data["rejected"]
    for c in data["candidates"]:
        assert CANDIDATE_KEYS <= set(c)
        layout = Layout(world_size=world, tp=c["tp"], cp=c["cp"], pp=c["pp"], dp=c["dp"],
                        order=c["order"], devices_per_node=per_node)
        assert violations(model, training, c["tp"], c["cp"], c["pp"], c["dp"]) == []
        same = estimate(layout, workload)
        assert c["fits"] is True and c["peak_bytes"] == same["memory"]["peak_bytes"] <= data["device_memory_bytes"]
        assert c["est_time_s"] == pytest.approx(same["communication"]["est_time_s"])
        assert c["bottleneck"] == same["communication"]["bottleneck"]
        assert c["step_time_s"] == pytest.approx(same["time"]["step_time_s"])
        assert c["breakdown"] == pytest.approx(same["time"]["breakdown"])
        assert sum(c["breakdown"].values()) == pytest.approx(c["step_time_s"])
        assert c["mfu"] == pytest.approx(same["time"]["mfu"]) and 0 < c["mfu"] <= 1
    # Fastest training step first; ties: lower peak memory.
    keys = [(c["step_time_s"], c["peak_bytes"]) for c in data["candidates"]]
    assert keys == sorted(keys)
    assert data["valid"] + sum(data["rejected"].values()) == len(list(size_choices(world)))


@pytest.mark.parametrize("model,world,per_node", [("gqa-7b", 64, 8), ("gpt3-175b", 4096, 8), ("sci-transformer-s", 64, 4)])
def test_suggest_returns_only_valid_layouts_sorted(model, world, per_node):
    result = invoke("suggest", "--model", model, "--world", world, "--devices-per-node", per_node,
                    "--top", 1000, "--format", "json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["world_size"], data["devices_per_node"]) == (world, per_node)
    check_candidates(data, load_workload(bundled_models()[model]), world, per_node)


def test_suggest_picks_the_fastest_order_of_each_size():
    workload = load_workload(bundled_models()["gqa-7b"])
    data = json.loads(invoke("suggest", "-m", "gqa-7b", "-w", 32, "--top", 1000, "--format", "json").stdout)
    import itertools

    for c in data["candidates"][:6]:
        times = [estimate(Layout(world_size=32, tp=c["tp"], cp=c["cp"], pp=c["pp"], order="-".join(o),
                                 devices_per_node=8), workload)["time"]["step_time_s"]
                 for o in itertools.permutations(("tp", "cp", "dp", "pp"))]
        assert c["step_time_s"] == pytest.approx(min(times))


def test_suggest_table_and_top():
    result = invoke("suggest", "-m", "gpt3-175b", "-w", 64)
    assert result.exit_code == 0, result.output
    assert "gpt3-175b on 64 devices (8 node(s) x 8)" in result.stdout
    assert "tp-cp-dp-pp" in result.stdout and "rejected sizes" in result.stdout
    data = json.loads(invoke("suggest", "-m", "gqa-7b", "-w", 64, "--top", 3, "--format", "json").stdout)
    assert len(data["candidates"]) == 3 and data["valid"] > 3


def test_device_memory_option_changes_what_fits():
    base = json.loads(invoke("suggest", "-m", "gpt3-175b", "-w", 64, "--format", "json").stdout)
    small = json.loads(invoke("suggest", "-m", "gpt3-175b", "-w", 64, "--device-memory-gb", 50,
                              "--top", 100, "--format", "json").stdout)
    assert small["valid"] < base["valid"] and small["device_memory_bytes"] == 50 * 1024**3


def test_nothing_fits_names_the_closest_and_why():
    result = invoke("suggest", "-m", "gpt3-175b", "-w", 8)
    assert result.exit_code == 1
    assert result.stdout == ""
    message = result.stderr
    assert "no layout of 8 devices fits 64.0 GiB" in message and "Closest: tp=8" in message
    assert "optimizer" in message and "over" in message and "recompute: full" in message
    data = json.loads(invoke("suggest", "-m", "gpt3-175b", "-w", 8, "--format", "json").stdout)
    assert data["candidates"] == [] and data["closest"]["fits"] is False
    assert data["closest"]["over_bytes"] > 0 and data["rejected"] == {"does not fit device memory": 20}


def test_no_size_meets_the_constraints():
    result = invoke("suggest", "-m", "gpt3-175b", "-w", 7)
    assert result.exit_code == 1
    assert "meets the model's constraints" in result.stderr and "num_layers % pp" in result.stderr


def test_write_saves_a_layout_plan_and_verify_accept(tmp_path):
    target = tmp_path / "best.yaml"
    result = invoke("suggest", "-m", "gqa-7b", "-w", 64, "--write", target, "--format", "json")
    assert result.exit_code == 0, result.stderr
    best = json.loads(result.stdout)["candidates"][0]
    layout = load_layout(target)
    assert (layout.tp, layout.cp, layout.dp, layout.pp, "-".join(layout.axes)) == (
        best["tp"], best["cp"], best["dp"], best["pp"], best["order"])
    assert (layout.world_size, layout.devices_per_node, layout.backend) == (64, 8, "ascend")
    assert load(str(target))[0] == layout  # what `msdist verify` reads
    planned = json.loads(invoke("plan", target, "--format", "json").stdout)
    assert planned["memory"]["peak_bytes"] == best["peak_bytes"]  # the model sections came along
    assert planned["communication"]["est_time_s"] == pytest.approx(best["est_time_s"])


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--world", "0"], "--world 0 is invalid"),
        (["--world", "64", "--devices-per-node", "6"], "--devices-per-node 6 is invalid"),
        (["--world", "64", "--device-memory-gb", "0"], "--device-memory-gb 0.0 is invalid"),
        (["--world", "64", "--top", "0"], "--top 0 is invalid"),
        (["--world", "64", "--format", "yaml"], "--format 'yaml' is invalid"),
        (["--world", "64", "--backend", "tpu"], "--backend 'tpu' is invalid"),
        (["--world", "64", "--write", "/no/such/dir/best.yaml"], "does not exist"),
    ],
)
def test_suggest_option_errors(args, fragment):
    assert_bad_input(invoke("suggest", "--model", "gqa-7b", *args), fragment)


# ------------------------------------------------------------------ zero stages, architecture, notes
def test_suggest_zero_stages_searches_each_and_reports_the_stage():
    args = ("suggest", "-m", "tiny-llama", "-w", 8, "--device", "cpu", "--top", 50, "--format", "json")
    data = json.loads(invoke(*args, "--zero-stages", "0,1,2,3").stdout)
    assert data["zero_stages"] == [0, 1, 2, 3]
    assert {c["zero_stage"] for c in data["candidates"]} <= {0, 1, 2, 3}
    only = {z: json.loads(invoke(*args, "--zero-stages", str(z)).stdout) for z in (0, 3)}
    for z in (0, 3):
        assert {c["zero_stage"] for c in only[z]["candidates"]} == {z}
    # Searching all stages keeps, per size, a step time no worse than each single stage's.
    best = {(c["tp"], c["cp"], c["dp"], c["pp"]): c["step_time_s"] for c in data["candidates"]}
    for z in (0, 3):
        for c in only[z]["candidates"]:
            assert best[(c["tp"], c["cp"], c["dp"], c["pp"])] <= c["step_time_s"]
    # Default: the model file's training.zero_stage (0 for tiny-llama).
    assert json.loads(invoke(*args).stdout)["zero_stages"] == [0]
    # The human table shows the stage column when several were searched.
    human = invoke("suggest", "-m", "tiny-llama", "-w", 8, "--device", "cpu", "--zero-stages", "1,3")
    assert human.exit_code == 0 and "zero" in human.stdout


def test_suggest_write_keeps_the_chosen_zero_stage(tmp_path):
    out = tmp_path / "best.yaml"
    result = invoke("suggest", "-m", "tiny-gpt", "-w", 4, "--device", "cpu", "--zero-stages", "3", "--write", out)
    assert result.exit_code == 0, result.output
    assert load_workload(out).training.zero_stage == 3


@pytest.mark.parametrize("args,fragments", [
    (("--zero-stages", "4"), ["--zero-stages '4' is invalid", "0, 1, 2, 3"]),
    (("--zero-stages", "1,x"), ["--zero-stages '1,x' is invalid"]),
])
def test_bad_zero_stages_are_one_line_errors(args, fragments):
    assert_bad_input(invoke("suggest", "-m", "tiny-gpt", "-w", 4, *args), *fragments)


@pytest.mark.parametrize("extra,fragments", [
    ("training:\n  zero_stage: 4\n", ["training.zero_stage=4 is invalid", "expected 0, 1, 2 or 3"]),
    ("training:\n  zero_stage: two\n", ["training.zero_stage", "one of 0, 1, 2, 3"]),
    ("training:\n  distributed_optimizer: true\n  zero_stage: 0\n", ["contradicts", "distributed_optimizer"]),
    ("training:\n  context_parallel_method: zigzag\n", ["context_parallel_method='zigzag'", "ulysses"]),
    ("training:\n  first_stage_layers: 0\n", ["first_stage_layers=0 is invalid"]),
    ("training:\n  first_stage_layers: 1\n  account_for_loss_in_pipeline_split: true\n", ["cannot be combined"]),
    ("  activation: relu\n", ["model.activation='relu' is invalid", "gelu, swiglu"]),
    ("  normalization: batchnorm\n", ["model.normalization='batchnorm' is invalid"]),
    ("  position_embedding: alibi\n", ["model.position_embedding='alibi' is invalid", "learned, rope"]),
    ("  tie_embeddings: 1\n", ["model.tie_embeddings", "true or false"]),
    ("  dropout: 1.5\n", ["model.dropout=1.5 is invalid", "[0, 1)"]),
])
def test_bad_architecture_and_training_values_exit_2(tmp_path, extra, fragments):
    model = SMALL_MODEL + extra if extra.startswith("  ") else SMALL_MODEL + extra
    path = write(tmp_path, model, "model.yaml")
    assert_bad_input(invoke("plan", "cpu-4", "--model", path), path, *fragments)
    assert_bad_input(invoke("suggest", "--model", path, "--world", "8"), path, *fragments)


def test_plan_notes_in_json_and_on_stderr(tmp_path, monkeypatch):
    from test_costmodel import _optimizer_rules

    _optimizer_rules(monkeypatch, {})  # the library before issue 37's overlap: notes say what it runs instead
    result = invoke("plan", "cpu-8-pp2", "-m", "tiny-gpt", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    notes = data["notes"]
    # The pipeline keeps its stage forwards: no pp note (pipeline.recompute.runtime_recompute).
    assert not any(n.startswith("pp=") for n in notes)
    assert any("overlap_grad_reduce" in n for n in notes)
    assert result.stderr.strip().splitlines() == [f"msdist: note: {n}" for n in notes]
    assert data["model"]["runtime"] == {"stage_recompute": False, "fsdp_units": False, "fsdp_gathers_per_unit": 1,
                                        "fsdp_units_alive": None}
    assert data["model"]["training"]["overlap_grad_reduce"] is True
    assert data["model"]["priced_training"]["overlap_grad_reduce"] is False
    assert data["model"]["architecture"]["activation"] == "gelu" and data["model"]["zero_stage"] == 0
    # The rich view prints the same notes on stderr.
    human = invoke("plan", "cpu-8-pp2", "-m", "tiny-gpt")
    assert human.exit_code == 0 and human.stderr.strip().splitlines() == [f"msdist: note: {n}" for n in notes]
    # tp only, no dp, no pipeline: the library runs what is configured, no note.
    quiet = invoke("plan", write(tmp_path, "world_size: 4\ntp: 4\n"), "-m", "tiny-gpt", "--format", "json")
    assert json.loads(quiet.stdout)["notes"] == [] and quiet.stderr == ""


def test_plan_carries_no_runtime_note_where_the_library_overlaps(tmp_path, monkeypatch):
    from test_costmodel import _optimizer_rules, _rules_of_issue_37

    _optimizer_rules(monkeypatch, _rules_of_issue_37())
    # 1F1B at tp2 x pp2 x dp2 and FSDP at dp4: kept stage forwards, the reduction overlapped after each
    # chunk's last backward, per-unit prefetched gathers: nothing priced differs from the configuration.
    data = json.loads(invoke("plan", "cpu-8-pp2", "-m", "tiny-gpt", "--format", "json").stdout)
    runtime_notes = [n for n in data["notes"] if not n.startswith("compiled mode:")]
    assert runtime_notes == [] and data["model"]["priced_training"]["overlap_grad_reduce"] is True
    model = write(tmp_path, SMALL_MODEL + "training:\n  zero_stage: 3\n", "model.yaml")
    data = json.loads(invoke("plan", write(tmp_path, "world_size: 4\n"), "-m", model, "--format", "json").stdout)
    assert data["notes"] == []
    assert data["model"]["runtime"] == {"stage_recompute": False, "fsdp_units": True, "fsdp_gathers_per_unit": 2,
                                        "fsdp_units_alive": 2}


def test_plan_memory_per_stage_with_unequal_stages(tmp_path):
    model = write(tmp_path, SMALL_MODEL.replace("num_layers: 4", "num_layers: 5")
                  + "training:\n  first_stage_layers: 2\n  zero_stage: 3\n", "model.yaml")
    layout = write(tmp_path, "world_size: 4\npp: 2\n", "layout.yaml")
    data = json.loads(invoke("plan", layout, "--model", model, "--format", "json", "--schedule", "1f1b").stdout)
    assert [s["layers"] for s in data["memory"]["stages"]] == [2, 3]
    assert data["model"]["stage_layers"] == [2, 3] and data["schedule"]["stage_layers"] == [2, 3]
    assert all(s["zero_stage"] == 3 and s["gathered_bytes"] > 0 for s in data["memory"]["stages"])
    assert any(n.startswith("--schedule: the model stages hold unequal layers [2, 3]") for n in data["notes"])
    # The same 1F1B order with durations in layers: rank 1's first forward waits for rank 0's (2 units) and
    # lasts 3; its backward 6. Rank 1 computes 8 x (3 + 6) = 72 units after its 2-unit wait, then rank 0's
    # last backward (4 units) follows it: makespan 2 + 72 + 4 = 78.
    first = data["schedule"]["layer_timeline"][1][:2]
    assert [(e["kind"], e["start"], e["end"]) for e in first] == [("F", 2, 5), ("B", 5, 11)]
    assert data["schedule"]["layer_makespan"] == 78
    human = invoke("plan", layout, "--model", model, "--schedule", "1f1b")
    assert human.exit_code == 0 and "gathered" in human.stdout and "ZeRO stage 3" in human.stdout


def test_calibrate_from_a_training_report(tmp_path):
    report = {"measured": {"step_time_s": 0.5}, "predicted": {"step_time_s": 0.25, "breakdown": {}},
              "layout": {"tp": 2}, "model": {"name": "tiny-gpt"}, "training": {}, "steps": [],
              "cluster": {"peak_tflops": 0.1, "compute_efficiency": 0.5}}
    path = write(tmp_path, json.dumps(report), "train.json")
    data = json.loads(invoke("plan", "cpu-4", "-m", "tiny-gpt", "--calibrate", path, "--format", "json").stdout)
    cluster = data["model"]["cluster"]
    # 0.1 x 0.5 TFLOP/s predicted a step twice as fast as measured: 0.025 TFLOP/s on the cpu-4 layout's peak.
    assert cluster["peak_tflops"] * cluster["compute_efficiency"] == pytest.approx(0.025)
    assert data["model"]["cluster_sources"]["compute_efficiency"].startswith(f"{path}: training run")
    bad = dict(report, measured={"step_time_s": 0})
    path = write(tmp_path, json.dumps(bad), "bad.json")
    assert_bad_input(invoke("plan", "cpu-4", "-m", "tiny-gpt", "--calibrate", path), path,
                     "measured.step_time_s is 0", "msdist train")
