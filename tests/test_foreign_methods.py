"""A name functree lacks: the public names like it, never a private module."""

import subprocess
import sys

import pytest

import functree as ft


@pytest.mark.parametrize("expr, suggested", [
    ("ft.paths", "ft.all_key_paths"),            # a substring of the public name
    ("ft.gradiant", "ft.gradient"),              # a misspelling
    ("ft.nn.Dence", "ft.nn.Dense"),
    ("ft.optim.adamm", "ft.optim.adam"),
])
def test_a_missing_name_suggests_public_names(expr, suggested):
    with pytest.raises(AttributeError, match="did you mean") as info:
        eval(expr, {"ft": ft})
    assert suggested in str(info.value)
    assert "_paths" not in str(info.value).replace("key_paths", "")


def test_nothing_like_it_and_private_probes_keep_pythons_message():
    with pytest.raises(AttributeError, match=r"^module 'functree' has no attribute 'zzqx'$"):
        ft.zzqx  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(AttributeError, match=r"^module 'functree.nn' has no attribute '_repr_html_'$"):
        ft.nn._repr_html_  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]
    assert not hasattr(ft, "__wrapped__")


def test_the_traceback_suggests_no_private_module():
    # Python's own "Did you mean: '_paths'?" read dir(functree), which lists the private modules.
    run = subprocess.run([sys.executable, "-c", "import functree as ft; ft.paths"], capture_output=True, text=True)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("AttributeError: module 'functree' has no attribute 'paths': did you mean ft.all_key_paths")
    assert "'_paths'" not in run.stderr


@pytest.mark.parametrize("build, name, field", [
    (lambda k: ft.nn.MultiheadAttention(8, 2, key=k), "q_proj", "query_projection"),
    (lambda k: ft.nn.MultiheadAttention(8, 2, key=k), "out_proj", "output_projection"),
    (lambda k: ft.nn.Embedding(5, 4, key=k), "weight", "embeddings"),
    (lambda k: ft.nn.LayerNorm(4), "bias", "offset"),
    (lambda k: ft.nn.RMSNorm(4), "weight", "scale"),
])
def test_a_torch_name_of_a_layers_part_names_functrees_field(build, name, field):
    """A user reading a Hugging Face state dict types attn.q_proj, embed_tokens.weight: the
    error names functree's field (Python's "did you mean" finds none of them)."""
    import jax

    layer = build(jax.random.key(0))
    with pytest.raises(AttributeError, match=rf"(?s)has no attribute '{name}': torch and Hugging Face call it {name}, "
                                             rf"functree's \w+ calls it {field}.*right:  layer.{field}"):
        getattr(layer, name)
    getattr(layer, field)  # the field it names exists


def test_a_hf_ports_attention_names_its_fields():
    import jax

    config = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2}
    attention = ft.nn.from_hf(config, key=jax.random.key(0)).model.layers.layers.self_attn
    with pytest.raises(AttributeError, match=r"calls it key_projection"):
        attention.k_proj  # noqa: B018


@pytest.mark.parametrize("name, right", [("restore", "ft.train.load(path, "), ("save_checkpoint", "ft.train.save(path, model)"),
                                         ("TensorBoard", "ft.train.TensorBoardLogger(log_dir)"),
                                         ("fit", "ft.train.Trainer(model, ")])
def test_train_names_of_other_libraries_name_functrees(name, right):
    """ft.train.restore (Orbax's name, and the Trainer's method) raised Python's bare error."""
    with pytest.raises(AttributeError, match=rf"^module 'functree.train' has no attribute {name!r}: ") as info:
        getattr(ft.train, name)
    assert f"right:  {right}" in str(info.value) or right in str(info.value)
    for called in ("load", "save", "TensorBoardLogger", "Trainer"):  # the names the fixes call exist
        assert callable(getattr(ft.train, called))
    with pytest.raises(AttributeError, match=r"did you mean ft.train.load\?"):
        ft.train.laod  # noqa: B018  # pyright: ignore[reportAttributeAccessIssue]


@pytest.mark.parametrize("name, says", [("ModuleList", "plain lists here"), ("ModuleDict", "plain dicts here"),
                                        ("Softmax", "the function ft.nn.softmax"), ("Identity", "ft.nn.identity"),
                                        ("scaled_dot_product_attention", "jax.nn.dot_product_attention"),
                                        ("dropout", "the layer ft.nn.Dropout")])
def test_torchs_containers_and_functional_names_name_functrees(name, says):
    """torch's nn.ModuleList, nn.Softmax, nn.Identity and F.scaled_dot_product_attention spelt on ft.nn
    raised Python's bare error (nn.Softmax: "did you mean ft.nn.log_softmax, ft.nn.softmax?", no word
    on dim=1 of NCHW being the last axis here)."""
    with pytest.raises(AttributeError, match=rf"^module 'functree.nn' has no attribute {name!r}: .*{says}"):
        getattr(ft.nn, name)


def test_the_fixes_the_container_and_softmax_hints_give_run():
    import jax
    import jax.numpy as jnp

    k = jax.random.key(0)
    probs = ft.nn.Sequential(ft.nn.Dense(4, 3, key=k), ft.nn.softmax, ft.nn.identity)(jnp.ones((2, 4)))
    assert jnp.allclose(probs.sum(-1), 1.0)

    class Net(ft.Module):
        layers: list[ft.nn.Dense]
        heads: dict[str, ft.nn.Dense]

        def __init__(self, keys):
            self.layers = [ft.nn.Dense(8, 8, key=key) for key in keys]
            self.heads = {"cls": ft.nn.Dense(8, 3, key=keys[0])}

    names = set(ft.to_flat_dict(Net(jax.random.split(k, 2))))
    assert {"layers.0.weight", "layers.1.bias", "heads.cls.weight"} <= names  # torch's names


def test_torchs_module_walk_and_keras_weights_name_functrees_and_the_walk_runs():
    """model.modules() (torch's re-initialisation loop), get_weights/set_weights (Keras),
    num_parameters (HF) and tabulate (Flax) raised Python's bare error. The walk's fix runs."""
    import jax

    from functree._foreign_methods import FOREIGN_METHODS

    k = jax.random.key(0)
    model = ft.nn.Sequential(ft.nn.Conv2D(3, 16, 3, key=k), ft.nn.relu, ft.nn.Conv2D(16, 64, 3, key=k))
    for name in ("modules", "named_modules", "children", "get_weights", "set_weights", "num_parameters", "tabulate"):
        with pytest.raises(AttributeError, match=rf"^'Sequential' object has no attribute {name!r}: "):
            getattr(model, name)
    right = FOREIGN_METHODS["modules"][2].replace(":  ", ":\n    ").replace(";  ", "\n    ")
    scope = {"ft": ft, "model": model, "k": jax.random.key(1)}
    exec(right, scope)  # the hint's own code, as a user pastes it
    walked = scope["model"]
    assert float(walked.layers[2].weight.std()) == pytest.approx((2 / (3 * 3 * 16)) ** 0.5, rel=0.05)
    assert not bool((walked.layers[2].weight == model.layers[2].weight).all())
    assert ft.summary(model).parameter_count == sum(x.size for x in jax.tree.leaves(model))
