"""PEFT's LoRA on a sparse MoE's stacked expert weights (``LoraConfig(target_parameters=...)``,
PEFT's ``lora.ParamWrapper``) against PEFT 0.21 itself: tiny Mixtral, Qwen3-MoE, OLMoE and Qwen2-MoE configs
with random weights (no download), float64, HF widened (``test_hf_mixtral.widened_moe``: its
router softmax, rotary and norms in float64), each adapter combined with ``target_modules``
on the attention. Both directions: PEFT's files read by ``ft.nn.load_lora`` (logits, the
loss, and the gradient of every lora_A / lora_B PEFT trains, mapped to ours), and
``ft.nn.save_lora``'s files read by ``PeftModel.from_pretrained``; merged equals unmerged.
Refusals: what PEFT allows (or refuses) that is not ported, each named.
"""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _peft_params, _qwen2_moe
from functree.nn import _lora, _lora_experts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
import test_hf_mixtral as mixtral  # noqa: E402
import test_hf_olmoe as olmoe  # noqa: E402
import test_hf_qwen2_moe as qwen2_moe  # noqa: E402
import test_hf_qwen3_moe as qwen3_moe  # noqa: E402
from test_hf_phi import _nonzero_b, batch  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              # PEFT checks rank_pattern / alpha_pattern against modules only, and warns of a parameter's key it uses
              pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")]
# float64 against HF widened: logits 3e-14 of the largest (measured 2.5e-15; PEFT reading ours
# 2.6e-15), loss relative (1.5e-16), gradients of the largest (3.5e-15), merged against
# unmerged (1.8e-15); Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE
WIDENED = 3e-14
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


FAMILIES = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "olmoe": olmoe, "qwen2_moe": qwen2_moe}


def _converted(family: str) -> bool:
    """Whether the installed PEFT's "all-linear" converts ``family`` (its router and stacked
    experts in target_parameters): Qwen2-MoE from PEFT 0.22 on."""
    return family != "qwen2_moe" or _qwen2_moe._peft_converts_qwen2_moe()


def make(family, seed):
    return mixtral.widened_moe(FAMILIES[family].hf_model(seed, torch.float64))


def peft_adapter(family, tmp_path, targets, parameters, **options):
    """PEFT's own adapter (``get_peft_model``, its B moved off 0) saved to ``tmp_path / "peft"``;
    returns the PeftModel."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's about its rank_pattern for parameters
        theirs = peft.get_peft_model(make(family, 6), peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=targets, target_parameters=parameters, **options))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    theirs.save_pretrained(tmp_path / "peft")
    return theirs


def loss_of(logits, ids, mask):
    shifted = logits[:, :-1]
    picked = jnp.take_along_axis(jax.nn.log_softmax(shifted, -1), ids[:, 1:, None], -1)[..., 0]
    real = (mask[:, :-1] * mask[:, 1:]).astype(picked.dtype)  # a real token predicting a real one
    return -jnp.sum(picked * real) / jnp.sum(real)


def torch_loss(model, ids, mask):
    logits = model(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long()).logits
    shifted = torch.log_softmax(logits[:, :-1], -1).gather(-1, torch.from_numpy(ids[:, 1:, None]).long())[..., 0]
    real = torch.from_numpy(mask[:, :-1] * mask[:, 1:]).to(shifted.dtype)
    return logits, -(shifted * real).sum() / real.sum()


def ours_of_peft_gradients(theirs, model):
    """PEFT's lora_A / lora_B gradients, as ours: ``{our leaf name: array}`` (a Stack's members
    stacked; an expert weight's through :func:`from_peft_tensors`, a Linear's transposed)."""
    flat = ft.to_flat_dict(model)
    names = {n.rpartition(".")[0] for n in flat if n.endswith(".lora_a")}
    found = {}
    for module, layer in theirs.base_model.model.named_modules():
        if not hasattr(layer, "lora_A") or "default" not in layer.lora_A:
            continue
        a, b = layer.lora_A["default"].weight.grad.numpy(), layer.lora_B["default"].weight.grad.numpy()
        index = int(module.split(".layers.")[1].split(".")[0])
        if getattr(layer, "parameter_name", "weight") in ("gate_up_proj", "down_proj"):
            mine = f"model.layers.layers.mlp.experts.{layer.parameter_name}"
            a, b = _lora_experts.from_peft_tensors(a, b, layer.num_experts)
        else:
            mine = next(n for n in names if n.endswith({"q_proj": "query_projection", "gate": "mlp.gate"}[
                module.rpartition(".")[2]]))
            a, b = a.T, b.T
        found.setdefault(f"{mine}.lora_a", {})[index] = a
        found.setdefault(f"{mine}.lora_b", {})[index] = b
    out = {}
    for name, by_layer in found.items():  # a layer of a lower rank: zero-padded to the largest, as ours
        axis = -1 if name.endswith("lora_a") else -2
        rank = max(x.shape[axis] for x in by_layer.values())
        padded = []
        for i in sorted(by_layer):
            x = by_layer[i]
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, rank - x.shape[axis])
            padded.append(np.pad(x, widths))
        out[name] = np.stack(padded)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_s_expert_adapters_are_read_with_its_logits_loss_and_gradients(family, tmp_path):
    """PEFT's adapter on q_proj (target_modules) and both expert weights (target_parameters;
    Mixtral's the router too, ``mlp.gate.weight``: a Linear's LoRA; Qwen3-MoE's with another
    rank and alpha for one layer's down_proj: the members' own ranks, padded, and scales;
    OLMoE's gate_up_proj alone, not renormalized; Qwen2-MoE's down_proj beside its shared
    expert, with Qwen3-MoE's rank and alpha for layer 1): ``load_lora``'s logits, loss and every
    adapter gradient are PEFT's; saved again, PEFT reads the same tensors back; merged, the
    same logits."""
    parameters = {"mixtral": [*EXPERTS, "mlp.gate.weight"], "qwen3_moe": EXPERTS,
                  "olmoe": ["experts.gate_up_proj"], "qwen2_moe": ["experts.down_proj"]}[family]
    options = {} if family == "mixtral" else {
        "rank_pattern": {r"model\.layers\.1\.mlp\.experts\.down_proj": 3},
        "alpha_pattern": {r"model\.layers\.1\.mlp\.experts\.down_proj": 7}, "use_rslora": True}
    theirs = peft_adapter(family, tmp_path, ["q_proj"], parameters, **options)
    ids, mask = batch()
    logits, loss = torch_loss(theirs, ids, mask)
    loss.backward()
    expected = logits.detach().numpy()
    real = mask.astype(bool)
    with jax.enable_x64(True):
        model = ft.nn.load_lora(ft.nn.from_hf(make(family, 6), dtype=jnp.float64), tmp_path / "peft")
        assert isinstance(model.model.layers.layers.mlp.experts, _lora_experts.LoraExperts)
        if family == "qwen3_moe":  # rank 3 for layer 1's down_proj: layer 0's padded, each its own scale
            down = model.model.layers.layers.mlp.experts.down_proj
            assert down.rank == 3 and np.allclose(np.asarray(down.member_scale), [4 / 2 ** 0.5, 7 / 3 ** 0.5])

        every = ft.to_flat_dict(model)
        adapters = {n: v for n, v in every.items() if ".lora_" in n}

        def value(trained):
            out = ft.from_flat_dict(model, {**every, **trained})(ids, mask)
            return loss_of(out, jnp.asarray(ids), jnp.asarray(mask)), out

        # one compiled program (eager, the backward's operations were each compiled apart)
        (mine, out), flat = jax.jit(jax.value_and_grad(value, has_aux=True))(adapters)
        top = float(np.abs(expected[real]).max())
        plain = np.asarray(ft.nn.from_hf(make(family, 6), dtype=jnp.float64)(ids, mask))
        assert np.abs(plain[real] - expected[real]).max() > 1e-3 * top  # the adapter matters
        np.testing.assert_allclose(np.asarray(out)[real], expected[real], rtol=0, atol=WIDENED * top)
        np.testing.assert_allclose(float(mine), loss.item(), rtol=WIDENED)
        peft_grads = ours_of_peft_gradients(theirs, model)
        assert len(peft_grads) == len([n for n in flat if ".lora_" in n]) == 2 * (1 + len(parameters))
        largest = max(float(np.abs(g).max()) for g in peft_grads.values())
        for name, g in peft_grads.items():
            np.testing.assert_allclose(np.asarray(flat[name]), g, rtol=0, atol=WIDENED * largest, err_msg=name)

        merged = ft.nn.merge_lora(model)
        assert type(merged.model.layers.layers.mlp.experts) is ft.nn.Experts
        np.testing.assert_allclose(np.asarray(merged(ids, mask))[real], np.asarray(out)[real], rtol=0,
                                   atol=WIDENED * top)

        ft.nn.save_lora(model, tmp_path / "again")
    written = safetensors_numpy.load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    original = safetensors_numpy.load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert written.keys() == original.keys()
    for name in original:
        np.testing.assert_array_equal(written[name], original[name], err_msg=name)
    again = peft.PeftModel.from_pretrained(make(family, 6), str(tmp_path / "again")).eval()
    with torch.no_grad():
        np.testing.assert_allclose(torch_loss(again, ids, mask)[0].numpy()[real], expected[real], rtol=0,
                                   atol=WIDENED * top)


@pytest.mark.parametrize("fields", [EXPERTS, ["experts.down_proj"]])
def test_ft_lora_on_the_experts_is_read_by_peft(fields, tmp_path):
    """``ft.nn.lora`` on q_proj and the expert weights (both: PEFT's nested wrappers; or
    down_proj alone), B moved off 0, ``save_lora``: PEFT's logits are ours; training the
    adapters alone (``wrt="*.lora_*"``) warns of nothing."""
    ids, mask = batch()
    real = mask.astype(bool)
    with jax.enable_x64(True):
        base = ft.nn.from_hf(make("mixtral", 5), dtype=jnp.float64)
        model = _nonzero_b(ft.nn.lora(base, ["*.q_proj", *(f"*.{f}" for f in fields)], rank=2, alpha=4,
                                      key=jax.random.key(1)))
        mine = np.asarray(model(ids, mask))
        for implementation in ("sorted", "gathered"):  # every form of the MoE reads the adapted weights
            layers = model.model.layers
            moe = layers.layers.mlp.replace(implementation=implementation)
            other = model.replace(model=model.model.replace(layers=layers.replace(
                layers=layers.layers.replace(mlp=moe))))
            np.testing.assert_allclose(np.asarray(other(ids, mask))[real], mine[real], rtol=0, atol=1e-12)
        ft.nn.save_lora(model, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["target_parameters"] == sorted(f"model.layers.{i}.mlp.{f}" for i in (0, 1) for f in fields)
    theirs = peft.PeftModel.from_pretrained(make("mixtral", 5), str(tmp_path / "ours")).eval()
    with torch.no_grad():
        expected = torch_loss(theirs, ids, mask)[0].numpy()
    top = float(np.abs(expected[real]).max())
    np.testing.assert_allclose(mine[real], expected[real], rtol=0, atol=WIDENED * top)


def edited(directory, tensors=None, **changes):
    """The adapter in ``directory`` with its config's ``changes`` (None: removed) and, where
    given, its tensors replaced."""
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    if tensors is not None:
        safetensors_numpy.save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


REFUSALS = {
    "not_ported": ({"target_parameters": ["embed_tokens.weight"]}, _peft_params.PARAMETER_NOT_PORTED),
    "nothing": ({"target_parameters": ["experts.up_proj"]}, _peft_params.PARAMETERS_SELECT_NOTHING),
    "dropout": ({"lora_dropout": 0.1}, _peft_params.PARAMETER_OPTION),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, _peft_params.PARAMETER_OPTION),
    "rank": ({"r": 3}, _peft_params.PARAMETER_SHAPE),
    "twice": ({"target_modules": ["q_proj", "gate"], "target_parameters": ["mlp.gate.weight", *EXPERTS]},
              _peft_params.TARGETED_TWICE),
    "missing": ("drop", _peft_params.PARAMETER_NOT_IN_FILE),
}


def test_what_is_not_ported_is_refused_naming_it(tmp_path):
    """Each refusal of an expert-weight adapter, by its message's opening: a parameter of
    another kind, a selection of nothing, lora_dropout / fan_in_fan_out (PEFT's ParamWrapper
    refuses both), tensors of another rank, the router targeted twice, a targeted weight
    without tensors; ft.nn.lora with dropout on the experts, on adapted experts; save_lora
    of expert adapters beside LoraDense dropout; load_lora onto adapted experts."""
    peft_adapter("mixtral", tmp_path, ["q_proj"], EXPERTS)
    original = (tmp_path / "peft" / "adapter_config.json").read_text()
    tensors = safetensors_numpy.load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    base = ft.nn.from_hf(make("mixtral", 6), dtype=jnp.float32)
    for case, (changes, message) in REFUSALS.items():
        (tmp_path / "peft" / "adapter_config.json").write_text(original)
        if changes == "drop":
            kept = {k: v for k, v in tensors.items() if "layers.1.mlp.experts.base_layer" not in k}
            directory = edited(tmp_path / "peft", kept)
        else:
            directory = edited(tmp_path / "peft", tensors, **changes)
        with pytest.raises(ValueError, match=message.split(":")[0].split("{")[0][:30]) as caught:
            ft.nn.load_lora(base, directory)
        assert "target_parameters" in str(caught.value) or case in ("rank", "missing"), case
    (tmp_path / "peft" / "adapter_config.json").write_text(original)
    adapted = ft.nn.load_lora(base, edited(tmp_path / "peft", tensors))
    with pytest.raises(ValueError, match="holds adapters"):
        ft.nn.load_lora(adapted, tmp_path / "peft")
    with pytest.raises(ValueError, match="already"):
        ft.nn.lora(adapted, "*.experts.gate_up_proj", rank=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"dropout=0\.1: an adapter on a stacked weight"):
        ft.nn.lora(base, ["*.q_proj", "*.experts.*"], rank=2, dropout=0.1, key=jax.random.key(0))
    dropping = ft.nn.lora(ft.nn.merge_lora(adapted), "*.k_proj", rank=2, dropout=0.1, key=jax.random.key(0))
    dropping = ft.nn.lora(dropping, "*.experts.down_proj", rank=2, key=jax.random.key(1))
    with pytest.raises(ValueError, match="refuses any lora_dropout != 0"):
        ft.nn.save_lora(dropping, tmp_path / "dropping")


def test_a_pattern_selecting_nothing_suggests_the_expert_weights():
    """PEFT's spelling of a target (``"experts.gate_up_proj"``, matched as a suffix there) is a
    glob here: the error names the expert weights closest to it and the pattern that runs
    (before, it offered attention layers and said "no Dense layer")."""
    base = ft.nn.from_hf(make("mixtral", 6), dtype=jnp.float32)
    for given, right in [("experts.gate_up_proj", "*.experts.gate_up_proj"), ("down_proj", "*.down_proj")]:
        with pytest.raises(ValueError, match="selects no Dense layer or expert weight") as caught:
            ft.nn.lora(base, given, rank=2, key=jax.random.key(0))
        message = str(caught.value)
        assert f"'model.layers.0.mlp.{right[2:] if right.startswith('*.experts') else 'experts.down_proj'}'" in message
        assert f"right:  ft.nn.lora(model, {right!r}, ...)" in message
        adapted = ft.nn.lora(base, right, rank=2, key=jax.random.key(0))  # the printed fix runs
        assert any(".experts." in k and k.endswith("lora_a") for k in ft.to_flat_dict(adapted))


def test_lora_experts_and_lora_parameter_built_by_hand_are_what_ft_nn_lora_builds():
    """ft.nn.LoraExperts / ft.nn.LoraParameter, exported: the adapters ft.nn.lora puts on a
    model's experts, built by hand from the same key, equal (leaf for leaf); each refusal named."""
    base = ft.nn.from_hf(make("mixtral", 6), dtype=jnp.float32)
    key = jax.random.key(3)
    adapted = ft.nn.lora(base, "*.experts.gate_up_proj", rank=2, alpha=4.0, key=key)
    moe = base.model.layers.layers.mlp
    by_lora = adapted.model.layers.layers.mlp.experts
    assert isinstance(by_lora, ft.nn.LoraExperts) and isinstance(by_lora.gate_up_proj, ft.nn.LoraParameter)
    # ft.nn.lora folds its key by the node's place: after the Dense layers, the first Experts
    fold = jax.random.fold_in(key, len(_lora.dense_layers(base)))
    by_hand = ft.nn.LoraExperts(moe.experts, 2, 4.0, key=fold, fields=("gate_up_proj",))
    assert jax.tree.structure(by_hand) == jax.tree.structure(by_lora)
    for a, b in zip(jax.tree.leaves(by_hand), jax.tree.leaves(by_lora)):
        np.testing.assert_array_equal(a, b)
    # lora_b is zero: the adapted experts compute what the plain ones do, in every form
    # (the Stack's first member, sliced in NumPy: eager a[0] compiled a slice and a squeeze a shape)
    first = lambda tree: jax.tree.map(lambda a: jax.device_put(np.asarray(a)[0]), tree)  # noqa: E731
    x = jax.device_put(np.random.default_rng(0).normal(size=(5, moe.experts.gate_up_proj.shape[-2])).astype(np.float32))
    np.testing.assert_array_equal(first(by_hand).every(x), first(moe.experts).every(x))
    with pytest.raises(TypeError, match=r"adapts an ft.nn.Experts .* got a SparseMoE"):
        ft.nn.LoraExperts(moe, key=key)
    # one field now, the other later: what both at once give (each field's key is its own fold)
    both = ft.nn.LoraExperts(moe.experts, 2, 4.0, key=fold)
    later = ft.nn.LoraExperts(by_hand, 2, 4.0, key=fold, fields=("down_proj",))
    assert jax.tree.structure(later) == jax.tree.structure(both)
    for a, b in zip(jax.tree.leaves(later), jax.tree.leaves(both)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"'gate_up_proj' holds an adapter already(.|\n)*ft.nn.merge_lora\(experts\)"):
        ft.nn.LoraExperts(by_hand, key=key, fields=("gate_up_proj",))
    with pytest.raises(ValueError, match=r"fields must name some of \('gate_up_proj', 'down_proj'\)"):
        ft.nn.LoraExperts(moe.experts, fields=("up_proj",), key=key)
    with pytest.raises(ValueError, match=r"a stacked expert weight \[\.\.\., experts, in, out\].*f32\[4,5\]"):
        ft.nn.LoraParameter(jnp.ones((4, 5)), key=key)
    with pytest.raises(ValueError, match="rank must be a positive int"):
        ft.nn.LoraParameter(moe.experts.down_proj, rank=0, key=key)


def test_lora_experts_group_sizes_that_do_not_count_the_rows_are_refused_or_nan_under_jit():
    """LoraExperts.grouped (the merged weights' ragged_dot) ran any sizes: a sum short of the
    rows gave a zero row past it. Now it checks them as Experts.grouped does: refused where
    concrete, every row NaN under jax.jit; the right sizes give the merged experts' rows."""
    experts = ft.nn.Experts(4, 6, 3, key=jax.random.key(0), std=1.0)
    adapted = ft.nn.LoraExperts(experts, rank=2, key=jax.random.key(1))
    adapted = adapted.replace(down_proj=adapted.down_proj.replace(lora_b=jnp.ones_like(adapted.down_proj.lora_b)))
    rows = jax.random.normal(jax.random.key(2), (5, 4))
    good = jnp.array([2, 0, 3])
    np.testing.assert_array_equal(adapted.grouped(rows, good), adapted.merged().grouped(rows, good))
    assert not np.array_equal(adapted.grouped(rows, good), experts.grouped(rows, good))  # the adapter counts
    with pytest.raises(ft.nn.LayerInputError, match=r"LoraExperts expects inputs group_sizes \[3\] \(int\) counting "
                                                    r"the rows, >= 0, summing to 5, got group_sizes \[2, 0, 2\] \(sum 4\)"):
        adapted.grouped(rows, jnp.array([2, 0, 2]))
    for bad in ([2, 0, 2], [4, -1, 2]):
        assert np.isnan(jax.jit(lambda e, s: e.grouped(rows, s))(adapted, jnp.array(bad))).all()


def peft_adapters(model):
    """``{module: (r, scaling)}`` of every LoRA layer of a PeftModel (a ParamWrapper's too)."""
    return {name.removeprefix("base_model.model."): (layer.r["default"], layer.scaling["default"])
            for name, layer in model.named_modules() if hasattr(layer, "lora_A") and "default" in layer.lora_A}


@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_adapts_what_peft_s_all_linear_adapts(family, tmp_path):
    """``ft.nn.lora(model, "all-linear")`` adapts what PEFT 0.21's ``"all-linear"`` adapts on
    the same Hugging Face model. Mixtral, Qwen3-MoE, OLMoE (PEFT's MoE conversion): the
    attention, the router's weight and both stacked expert weights, gate_up_proj at twice the
    rank and alpha. Qwen2-MoE (no conversion): the attention, the shared expert and its gate,
    not the router (transformers 5's TopKRouter is no Linear; before, ours adapted it and PEFT
    refused the file). ``save_lora``'s tensors have PEFT's names and shapes, PEFT builds the
    same adapters from it (each module's rank and scale), and its logits are ours (float64)."""
    theirs = peft_adapter(family, tmp_path, "all-linear", None)
    ids, mask = batch()
    real = mask.astype(bool)
    with jax.enable_x64(True):
        ours = _nonzero_b(ft.nn.lora(ft.nn.from_hf(make(family, 5), dtype=jnp.float64), "all-linear", rank=2,
                                     alpha=4, key=jax.random.key(1)))
        logits = np.asarray(ours(ids, mask))
        ft.nn.save_lora(ours, tmp_path / "ours")
    written = safetensors_numpy.load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    original = safetensors_numpy.load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in original.items()}
    assert any(".experts." in k for k in original) == _converted(family)
    assert any(".mlp.gate." in k for k in original) == _converted(family)
    loaded = peft.PeftModel.from_pretrained(make(family, 5), str(tmp_path / "ours")).eval()
    assert peft_adapters(loaded) == peft_adapters(theirs)
    with torch.no_grad():
        expected = torch_loss(loaded, ids, mask)[0].numpy()
        plain = torch_loss(make(family, 5), ids, mask)[0].numpy()
    top = float(np.abs(expected[real]).max())
    assert np.abs(plain[real] - expected[real]).max() > 1e-3 * top  # the adapters matter
    np.testing.assert_allclose(logits[real], expected[real], rtol=0, atol=WIDENED * top)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_adapted_router_is_written_as_peft_writes_it(family, tmp_path):
    """An adapter on the router (``"*.mlp.gate"``) is written in ``target_parameters``
    (``...mlp.gate.weight``: PEFT's ParamWrapper, as its own "all-linear" writes Mixtral's), not
    ``target_modules``, where PEFT refuses transformers 5's TopKRouter unless its MoE
    conversion rewrites the name (Qwen2-MoE: "Target module Qwen2MoeTopKRouter() is not
    supported" before): PEFT's logits are ours, and load_lora reads the file back. With
    dropout on a LoraDense, save_lora refuses (PEFT's ParamWrapper would), naming the router."""
    ids, mask = batch()
    real = mask.astype(bool)
    with jax.enable_x64(True):
        ours = _nonzero_b(ft.nn.lora(ft.nn.from_hf(make(family, 5), dtype=jnp.float64), ["*.q_proj", "*.mlp.gate"],
                                     rank=2, alpha=4, key=jax.random.key(1)))
        logits = np.asarray(ours(ids, mask))
        ft.nn.save_lora(ours, tmp_path / "ours")
        again = ft.nn.load_lora(ft.nn.from_hf(make(family, 5), dtype=jnp.float64), tmp_path / "ours")
        np.testing.assert_array_equal(np.asarray(again(ids, mask)), logits)
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["target_parameters"] == [f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)]
    assert config["target_modules"] == [f"model.layers.{i}.self_attn.q_proj" for i in (0, 1)]
    loaded = peft.PeftModel.from_pretrained(make(family, 5), str(tmp_path / "ours")).eval()
    with torch.no_grad():
        expected = torch_loss(loaded, ids, mask)[0].numpy()
    top = float(np.abs(expected[real]).max())
    np.testing.assert_allclose(logits[real], expected[real], rtol=0, atol=WIDENED * top)
    dropping = ft.nn.lora(ft.nn.from_hf(make(family, 5)), "*.k_proj", rank=2, dropout=0.1, key=jax.random.key(0))
    dropping = ft.nn.lora(dropping, "*.mlp.gate", rank=2, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"target_parameters \(a sparse MoE's expert weights or router: "
                                         r"model\.layers\.0\.mlp\.gate\.weight\)(.|\n)*refuses any lora_dropout"):
        ft.nn.save_lora(dropping, tmp_path / "dropping")


def test_all_linear_with_dropout_is_refused_where_it_adapts_expert_weights():
    """PEFT refuses ``"all-linear"`` with lora_dropout on Mixtral (its ParamWrapper on the
    experts and router); here the same refusal names the expert weight and both fixes, which
    run. On Qwen2-MoE "all-linear" adapts Linears alone, and dropout is taken."""
    base = ft.nn.from_hf(make("mixtral", 6), dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"\"all-linear\" adapts this model's stacked expert weights "
                                         r"\('model\.layers\.layers\.mlp\.experts\.gate_up_proj'\)") as caught:
        ft.nn.lora(base, "all-linear", rank=2, dropout=0.1, key=jax.random.key(0))
    assert 'right:  ft.nn.lora(model, "all-linear", ...)' in str(caught.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="ParamWrapper does not work with lora_dropout"):
            peft.get_peft_model(make("mixtral", 6), peft.LoraConfig(r=2, target_modules="all-linear",
                                                                   lora_dropout=0.1))
    fixed = ft.nn.lora(base, "*.self_attn.*_proj", rank=2, dropout=0.1, key=jax.random.key(0))
    assert sum(k.endswith("lora_a") for k in ft.to_flat_dict(fixed)) == 4
    qwen = ft.nn.from_hf(make("qwen2_moe", 6))
    if _converted("qwen2_moe"):  # PEFT 0.22 converts Qwen2-MoE as Mixtral: the same refusal
        with pytest.raises(ValueError, match=r"adapts this model's stacked expert weights"):
            ft.nn.lora(qwen, "all-linear", rank=2, dropout=0.1, key=jax.random.key(0))
        return
    dropped = ft.nn.lora(qwen, "all-linear", rank=2, dropout=0.1, key=jax.random.key(0))
    assert {layer.node.dropout for layer in _lora.dense_layers(dropped) if isinstance(layer.node, ft.nn.LoraDense)} == {0.1}


def test_all_linear_inside_a_model_of_your_own_is_peft_s_there(tmp_path):
    """A from_hf Mixtral held by a model of one's own (``lm``, beside a ``head``): PEFT's
    ``"all-linear"`` on the torch module holding HF's model adapts its Linears alone (no
    config to convert by: not the router, not the experts; its ``lm_head`` too, as no
    PreTrainedModel is at the root), and so does ours; save_lora names the same modules."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm, self.head = make("mixtral", 6), torch.nn.Linear(4, 2)

    class Ours(ft.Module):
        lm: object
        head: ft.nn.Dense

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(Holder(), peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    with jax.enable_x64(True):
        model = Ours(lm=ft.nn.from_hf(make("mixtral", 6), dtype=jnp.float64),
                     head=ft.nn.Dense(4, 2, key=jax.random.key(0), dtype=jnp.float64))
        adapted = ft.nn.lora(model, "all-linear", rank=2, alpha=4, key=jax.random.key(1))
        ft.nn.save_lora(adapted, tmp_path)
    assert not isinstance(adapted.lm.model.layers.layers.mlp.gate, ft.nn.LoraDense)
    assert type(adapted.lm.model.layers.layers.mlp.experts) is ft.nn.Experts
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    assert set(written["target_modules"]) == set(peft_adapters(theirs)) and not written["target_parameters"]
    assert "lm.model.layers.0.self_attn.q_proj" in written["target_modules"] and "head" in written["target_modules"]


def test_all_linear_on_a_moe_sequence_classifier_is_peft_s(tmp_path):
    """``MixtralForSequenceClassification`` (a task class of :mod:`functree.hf._heads`, which
    takes the family's ``hf_all_linear``): ``"all-linear"`` adapts what PEFT's does under
    ``task_type="SEQ_CLS"`` (the router and the experts too; before, neither, as the task class
    lacked the family's list); ``save_lora``'s file, loaded by PEFT, holds PEFT's adapters,
    each at its rank and scale, beside the ``score`` head written whole."""
    make_classifier = lambda: mixtral.hf_model(5, cls="MixtralForSequenceClassification")  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(make_classifier(), peft.LoraConfig(r=2, lora_alpha=4, target_modules="all-linear",
                                                                        task_type="SEQ_CLS"))
    ours = ft.nn.lora(ft.nn.from_hf(make_classifier()), "all-linear", rank=2, alpha=4, key=jax.random.key(1))
    ft.nn.save_lora(ours, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    loaded = peft.PeftModel.from_pretrained(make_classifier(), str(tmp_path))
    assert peft_adapters(loaded) == peft_adapters(theirs)
    assert any(".experts" in name for name in peft_adapters(theirs))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hand_written_all_linear_config_is_read_as_peft_reads_it(family, tmp_path):
    """A config that keeps PEFT's shorthand (``"target_modules": "all-linear"``, no
    ``target_parameters``, no patterns: hand-written; PEFT saves what it resolved) beside
    PEFT's tensors of its own ``"all-linear"``: PEFT reads it with its MoE conversion (the
    router's weight and the expert weights, gate_up_proj at twice the rank, on Mixtral,
    Qwen3-MoE and OLMoE; the Linears alone on Qwen2-MoE), and so does ``load_lora`` (before,
    it took the router for a Linear: "holds tensors for ...mlp.experts, which name no Dense
    layer", or, on Qwen2-MoE, "selects mlp.gate but holds no lora_A"). PEFT's logits."""
    peft_adapter(family, tmp_path, "all-linear", None)
    directory = edited(tmp_path / "peft", target_modules="all-linear", target_parameters=None, rank_pattern={},
                       alpha_pattern={})
    ids, mask = batch()
    real = mask.astype(bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.PeftModel.from_pretrained(make(family, 6), str(directory)).eval()
    expected, _ = torch_loss(theirs, ids, mask)
    expected = expected.detach().numpy()
    with jax.enable_x64(True):
        model = ft.nn.load_lora(ft.nn.from_hf(make(family, 6), dtype=jnp.float64), directory)
        logits = np.asarray(model(ids, mask))
    assert isinstance(model.model.layers.layers.mlp.experts, _lora_experts.LoraExperts) == _converted(family)
    top = float(np.abs(expected[real]).max())
    np.testing.assert_allclose(logits[real], expected[real], rtol=0, atol=WIDENED * top)
