"""MoE layer (mindscience.distributed.moe): the router and losses on one process against
numpy, option validation, and (multiprocess, one family of the shared 4-rank launch,
tests/_moe_job.py) the layer at ep2, ep4, ep2 x tp2 (etp 1 and 2) and ep2 x cp2 against
the one-rank layer, the uneven all-to-all, the error cases and 5 training steps with
DistributedOptimizer stages 0-3."""

from __future__ import annotations

import numpy as np
import pytest

import _moe_job as job_mod
from mindscience.distributed.moe import MoEConfig, MoEConfigError, capacity

H, E = 6, 8


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _router(**opts):
    import mindspore as ms

    from mindscience.distributed.moe import TopKRouter

    cfg = MoEConfig(hidden_size=H, num_experts=E, ffn_hidden_size=4, **opts)
    router = TopKRouter(cfg)
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1, (E, H)).astype(np.float32)
    router.weight.set_data(ms.Tensor(w))
    x = rng.normal(0, 1, (10, H)).astype(np.float32)
    return cfg, router, w, x


def _run(router, x, num_seqs=1):
    import mindspore as ms

    idx, weights, routed, sums = router(ms.Tensor(x), num_seqs)
    return idx.asnumpy(), weights.asnumpy(), routed.asnumpy(), sums.asnumpy()


def _topk(scores, k):
    return np.argsort(-scores, -1, kind="stable")[:, :k]


def test_softmax_after_topk_is_megatrons_default():
    cfg, router, w, x = _router(topk=2)
    idx, weights, routed, sums = _run(router, x)
    logits = x @ w.T
    want = _topk(logits, 2)
    assert (np.sort(idx, -1) == np.sort(want, -1)).all()
    sel = np.take_along_axis(logits, idx, 1)
    np.testing.assert_allclose(weights, _softmax(sel), rtol=1e-5)
    assert routed.sum() == 20 and (routed.sum(1) == 2).all()
    np.testing.assert_allclose(sums[:E], _softmax(logits).sum(0), rtol=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(sums[E], (lse ** 2).sum(), rtol=1e-5)


def test_router_from_keywords_or_a_model_config_routes_as_from_its_moe_config():
    import mindspore as ms

    from mindscience.distributed.models import TransformerConfig
    from mindscience.distributed.moe import TopKRouter

    cfg, router, w, x = _router(topk=2, score_function="sigmoid")
    by_keywords = TopKRouter(hidden_size=H, num_experts=E, topk=2, score_function="sigmoid")
    by_keywords.weight.set_data(ms.Tensor(w))
    for got, want in zip(_run(by_keywords, x), _run(router, x)):
        np.testing.assert_array_equal(got, want)
    model = TransformerConfig.from_model_spec("tiny-moe")
    from_model = TopKRouter(model)
    assert from_model.weight.shape == (model.num_moe_experts, model.hidden_size)
    assert from_model.topk == model.moe_router_topk
    with pytest.raises(MoEConfigError, match="topk=9"):
        TopKRouter(hidden_size=H, num_experts=E, topk=9)
    with pytest.raises(TypeError, match="not both"):
        TopKRouter(cfg, topk=2)


def test_pre_softmax_and_scaling_factor():
    cfg, router, w, x = _router(topk=3, pre_softmax=True, topk_scaling_factor=2.5)
    idx, weights, _, _ = _run(router, x)
    probs = _softmax(x @ w.T)
    np.testing.assert_allclose(weights, 2.5 * np.take_along_axis(probs, idx, 1), rtol=1e-5)
    assert set(map(tuple, np.sort(idx, -1))) == set(map(tuple, np.sort(_topk(probs, 3), -1)))


def test_sigmoid_scores_are_normalised_over_the_selected():
    cfg, router, w, x = _router(topk=2, score_function="sigmoid")
    idx, weights, _, sums = _run(router, x)
    s = 1 / (1 + np.exp(-(x @ w.T)))
    assert (np.sort(idx, -1) == np.sort(_topk(s, 2), -1)).all()
    sel = np.take_along_axis(s, idx, 1)
    np.testing.assert_allclose(weights, sel / sel.sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(sums[:E], (s / s.sum(-1, keepdims=True)).sum(0), rtol=1e-5)


def test_group_limited_routing_picks_inside_the_best_groups():
    cfg, router, w, x = _router(topk=2, score_function="sigmoid", num_groups=4, group_topk=2)
    idx, _, _, _ = _run(router, x)
    s = 1 / (1 + np.exp(-(x @ w.T)))
    groups = s.reshape(10, 4, 2)
    group_score = np.sort(groups, -1)[:, :, -1:].sum(-1)  # topk // group_topk = 1 per group
    best = np.argsort(-group_score, -1)[:, :2]
    masked = np.full_like(s, -1e30)
    for n in range(10):
        for g in best[n]:
            masked[n, 2 * g:2 * g + 2] = s[n, 2 * g:2 * g + 2]
    assert (np.sort(idx, -1) == np.sort(_topk(masked, 2), -1)).all()


def test_expert_bias_moves_the_selection_not_the_weights():
    import mindspore as ms

    cfg, router, w, x = _router(topk=2, score_function="sigmoid", enable_expert_bias=True,
                                bias_update_rate=0.5)
    bias = np.zeros(E, np.float32)
    bias[[3, 5]] = 10.0
    router.expert_bias.set_data(ms.Tensor(bias))
    idx, weights, _, _ = _run(router, x)
    assert (np.sort(idx, -1) == [3, 5]).all()
    s = 1 / (1 + np.exp(-(x @ w.T)))
    sel = np.take_along_axis(s, idx, 1)
    np.testing.assert_allclose(weights, sel / sel.sum(-1, keepdims=True), rtol=1e-5)
    counts = np.array([0, 0, 0, 10, 0, 10, 0, 0], np.float32)
    new = router.update_expert_bias(counts)
    np.testing.assert_allclose(new, bias + 0.5 * np.sign(counts.mean() - counts))


def _layer_losses(**opts):
    import mindspore as ms

    from mindscience.distributed.harness.checks.moe import one_rank_layer

    cfg = MoEConfig(hidden_size=H, num_experts=E, ffn_hidden_size=4, topk=2, **opts)
    layer = one_rank_layer(cfg)
    rng = np.random.default_rng(1)
    w = rng.normal(0, 1, (E, H)).astype(np.float32)
    layer.router.weight.set_data(ms.Tensor(w))
    x = rng.normal(0, 1, (5, 3, H)).astype(np.float32)  # S=5, B=3
    _, aux, stats = layer(ms.Tensor(x))
    return cfg, float(aux.asnumpy()), stats.asnumpy(), x.reshape(15, H) @ w.T


def test_aux_and_z_loss_against_numpy():
    cfg, aux, stats, logits = _layer_losses(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    probs = _softmax(logits)
    chosen = _topk(logits, 2)
    counts = np.zeros(E)
    for row in chosen:
        counts[row] += 1
    np.testing.assert_allclose(stats[:E], counts)
    assert stats[E] == 0  # dropless
    n = 15
    f = counts / (n * 2)
    p = probs.mean(0)
    lse = np.log(np.exp(logits).sum(-1))
    want = 0.1 * E * (f * p).sum() + 0.01 * (lse ** 2).mean()
    assert aux == pytest.approx(want, rel=1e-5)


def test_seq_aux_loss_averages_per_sequence():
    cfg, aux, _, logits = _layer_losses(aux_loss_coeff=0.1, load_balancing_type="seq_aux_loss")
    probs = _softmax(logits).reshape(5, 3, E)  # tokens are (S, B) flattened
    chosen = _topk(logits, 2).reshape(5, 3, 2)
    per = []
    for b in range(3):
        counts = np.zeros(E)
        for s in range(5):
            counts[chosen[s, b]] += 1
        per.append(E * ((counts / (5 * 2)) * probs[:, b].mean(0)).sum())
    assert aux == pytest.approx(0.1 * np.mean(per), rel=1e-5)


def test_capacity_drops_are_counted():
    cfg, aux, stats, _ = _layer_losses(capacity_factor=0.5)
    cap = capacity(cfg, 15)
    assert cap == 2  # ceil(0.5 * 15 tokens * top-2 / 8 experts) = ceil(1.875)
    kept = np.minimum(stats[:E], cap).sum()
    assert stats[E] == stats[:E].sum() - kept


@pytest.mark.parametrize("opts, fragment", [
    (dict(topk=9), "topk=9"),
    (dict(num_groups=3, group_topk=1), "num_groups=3"),
    (dict(num_groups=4, group_topk=3, topk=2), "group_topk=3"),
    (dict(capacity_factor=0), "capacity_factor=0"),
    (dict(capacity_factor=-0.5), "capacity_factor=-0.5"),
    (dict(num_groups=4), "both"),
    (dict(score_function="relu"), "score_function='relu'"),
])
def test_bad_options_raise_a_typed_error_naming_the_value(opts, fragment):
    with pytest.raises(MoEConfigError, match=fragment.replace("(", r"\(")):
        MoEConfig(hidden_size=H, num_experts=E, ffn_hidden_size=4, **{"topk": 2, **opts})


def test_experts_not_divisible_by_ep_names_the_divisors():
    from mindscience.distributed.moe import check_layout

    cfg = MoEConfig(hidden_size=H, num_experts=6, ffn_hidden_size=4)
    with pytest.raises(MoEConfigError, match=r"num_experts=6 is not divisible by ep=4.*\[1, 2, 3, 6\]"):
        check_layout(cfg, 4, 1)
    with pytest.raises(MoEConfigError, match="ffn_hidden_size=4 is not divisible by etp=3"):
        check_layout(cfg, 2, 3)


# ------------------------------------------------------------------ multiprocess
@pytest.fixture(scope="module")
def job():
    result = job_mod.run_job()
    assert result.ok, job_mod.describe_failures(result)
    return result


def _layer_records(job):
    return job_mod.records_of(job, "moe.layer")


@pytest.mark.multiprocess
def test_4ranks_layer_matches_the_one_rank_layer(job):
    """Outputs, aux loss (mean over dp-cp) and every gradient after GradientFinalizer within
    1e-5 relative, at ep2, ep4, ep2 x tp2 (etp 1, 2), ep2 x cp2, dropless and with capacity,
    both dispatchers, PyNative and jit."""
    records = _layer_records(job)
    seen = {(r["layout"], r["case"], r["mode"]) for r in records}
    layouts = {r["layout"] for r in records}
    assert layouts == {"tp1-cp1-dp4-ep2-etp1", "tp1-cp1-dp4-ep4-etp1", "tp2-cp1-dp2-ep2-etp1",
                       "tp2-cp1-dp2-ep2-etp2", "tp1-cp2-dp2-ep2-etp1"}
    assert len(records) == 4 * len(seen) and sum(1 for s in seen if s[2] == "jit") == 2
    for r in records:
        assert r["passed"], r
        assert r["max_error"] <= 1e-5, r
        assert set(r["errors"]) >= {"output", "dx", "grad.router", "grad.w1", "grad.w2"}
    with_aux = [r for r in records if "aux" in r["errors"]]
    assert len({(r["layout"], r["case"]) for r in with_aux}) >= 7
    assert all(r["ref_aux"] > 0 for r in with_aux)


@pytest.mark.multiprocess
def test_4ranks_capacity_drops_tokens_and_stays_exact(job):
    records = [r for r in _layer_records(job) if "capacity" in r["case"]]
    assert records and all(r["passed"] for r in records)
    assert any(r["stats"][-1] > 0 for r in records)  # assignments were dropped somewhere


@pytest.mark.multiprocess
def test_4ranks_a_rank_whose_experts_receive_no_token(job):
    records = [r for r in _layer_records(job) if r["case"] == "no_tokens"]
    assert len(records) == 4
    got = sorted(r["tokens_to_my_experts"] for r in records)
    assert got[0] == 0.0 and got[-1] > 0  # ep rank 0 gets every token, the others none
    assert all(r["passed"] for r in records)


@pytest.mark.multiprocess
def test_4ranks_uneven_all_to_all_and_round_trip(job):
    records = job_mod.records_of(job, "moe.dispatch")
    assert len(records) == 8 and {r["mode"] for r in records} == {"pynative", "jit"}
    for r in records:
        assert r["passed"] and r["max_error"] == 0.0, r
        sizes = np.array(r["sizes"])
        assert (sizes[-1] == 0).all() and len(set(sizes.ravel().tolist())) > 1


@pytest.mark.multiprocess
def test_4ranks_errors_are_typed_and_raised_before_any_collective(job):
    records = job_mod.records_of(job, "moe.errors")
    assert len(records) == 4 * 6
    for r in records:
        assert r["error"] == "MoEConfigError" and r["collectives"] == 0, r
    assert any("divisible by ep=4" in r["message"] for r in records)


@pytest.mark.multiprocess
def test_4ranks_training_every_zero_stage_matches_one_rank(job):
    records = job_mod.records_of(job, "moe.train")
    assert sorted({r["stage"] for r in records}) == [0, 1, 2, 3] and len(records) == 16
    for r in records:
        assert r["passed"] and r["errors"]["losses"] <= 1e-5, r
        assert len(r["losses"]) == 5
    # Stages 1-3 shard the expert state over edp (2 ranks): less than stage 0's.
    by_stage = {r["stage"]: r["expert_state_elements"] for r in records}
    assert by_stage[1] < by_stage[0] and by_stage[3] == by_stage[2] == by_stage[1]


@pytest.mark.multiprocess
def test_4ranks_dropless_dispatch_moves_what_the_cost_model_prices(job):
    """PyNative dropless: the (token, expert) rows sorted by expert through an uneven
    all-to-all, which on the composed CPU backend (an all-gather) needs no padding: each
    rank's ep all-to-alls (and etp gathers) move exactly its tokens x topk rows, the cost
    model's bytes at the measured imbalance 1, less than the compiled static slots (E/topk x
    the rows), which moe_static_slots prices. The experts' rows, each local expert padded
    to the busiest for the batched matmul, are above the mean on the skewed router's rank."""
    records = job_mod.records_of(job, "moe.bytes")
    assert len(records) == 8
    assert {r["layout"] for r in records} == {"tp1-cp1-dp4-ep4-etp1", "tp2-cp1-dp2-ep2-etp2"}
    for r in records:
        assert r["passed"], r
        rec = r["record"]
        assert rec["step_all_to_all_bytes"] == r["priced_all_to_all_bytes"] > 0, r
        assert 2 * rec["etp_bytes"] == r["priced_etp_all_gather_bytes"], r
        assert 4 * rec["static_all_to_all_bytes"] == r["priced_static_all_to_all_bytes"], r
        assert rec["rows"] == 2 * rec["tokens"] and rec["imbalance"] == 1.0, r  # topk 2, no padding
        assert rec["rows"] == 8 * rec["slot"] and rec["slot"] < rec["tokens"], r
        assert rec["all_to_all_bytes"] < rec["static_all_to_all_bytes"], r
    for layout in {r["layout"] for r in records}:
        sel = [r["record"] for r in records if r["layout"] == layout]
        # Every rank routes as many tokens: every rank moves the same bytes.
        assert len({rec["rows"] for rec in sel}) == 1
        etp = 2 if layout.endswith("etp2") else 1
        # The favourite expert's rank multiplies more than the mean (etp x rows per ep rank).
        assert max(rec["expert_rows"] for rec in sel) > etp * sel[0]["rows"], sel


@pytest.mark.multiprocess
def test_4ranks_max_grad_norm_with_experts_is_the_one_rank_norm(job):
    """max_grad_norm with expert weights: the returned norm equals the one-rank model's at
    tp2 x ep2 (etp 1: edp 2; etp 2: edp 1) and ZeRO stages 0, 1 and 3, and the clipped
    steps match the one-rank optimizer's (losses, expert and router weights)."""
    records = job_mod.records_of(job, "moe.clip")
    assert len(records) == 4 * 3 + 4
    assert {(r["layout"], r["stage"]) for r in records} == {
        ("tp2-cp1-dp2-ep2-etp1", 0), ("tp2-cp1-dp2-ep2-etp1", 1), ("tp2-cp1-dp2-ep2-etp1", 3),
        ("tp2-cp1-dp2-ep2-etp2", 1)}
    for r in records:
        assert r["passed"] and r["errors"]["norms"] <= 1e-5 and r["errors"]["losses"] <= 1e-5, r
        assert len(r["norms"]) == 3
        assert min(r["ref_norms"]) > r["max_grad_norm"], r  # every step was clipped


def test_static_slots_are_priced_as_experts_over_topk():
    from dataclasses import replace

    from mindscience.distributed.costmodel.comm import moe_rows
    from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec
    from mindscience.distributed.moe import dispatch_record

    model = ModelSpec(num_layers=1, hidden_size=16, num_attention_heads=1, seq_length=32, vocab_size=0,
                      num_moe_experts=8, moe_router_topk=2)
    training = TrainingSpec(micro_batch_size=1, precision="fp32")
    dyn = moe_rows(model, training, 1, 1, 4, 1, passes=1, again=0)[0]
    static = moe_rows(model, replace(training, moe_static_slots=True), 1, 1, 4, 1, passes=1, again=0)[0]
    assert static["bytes"] == 4 * dyn["bytes"]  # E / topk = 4
    # 32 tokens, balanced: a slot of 32 * 2 / 8 = 8 rows per expert.
    rec = dispatch_record(8, 2, 4, 1, 32, 8, 16, 4)
    assert rec["imbalance"] == 1.0 and rec["step_all_to_all_bytes"] == dyn["bytes"]
    assert 4 * rec["static_all_to_all_bytes"] == static["bytes"] == 4 * 3 * 2 * 32 * 16 * 4


def test_all_to_all_v_checks_its_size_matrix_before_any_collective():
    import mindspore as ms

    from mindscience.distributed import collectives as C
    from mindscience.distributed.group import ParallelGroup

    x = ms.Tensor(np.ones((3, 2), np.float32))
    one = ParallelGroup.trivial("ep")
    assert (C.all_to_all_v(x, one, [[3]]).asnumpy() == 1).all()  # size 1: the identity
    with pytest.raises(ValueError, match="must be a 1 x 1 matrix"):
        C.all_to_all_v(x, one, [3])
    with pytest.raises(ValueError, match="sends 2 rows .* but x has 3 rows"):
        C.all_to_all_v(x, one, [[2]])
    two = ParallelGroup(key="ep", ranks=(0, 1), rank=0, backend_name="never-created")
    with pytest.raises(ValueError, match="must be a 2 x 2 matrix"):
        C.all_to_all_v(x, two, [[1, 2], [3, -1]])
