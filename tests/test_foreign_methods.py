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
