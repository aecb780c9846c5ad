"""Built-in models, the ~1M-parameter MLP, determinism, and user ``package.module:factory`` models."""

from __future__ import annotations

import math
import sys
import textwrap
import uuid

import pytest
import torch
from torch import nn

from distrain.errors import ConfigError
from distrain.models import (
    MLP,
    MODELS,
    CNN1d,
    CNN2d,
    build_model,
    count_parameters,
    mlp_width_for_params,
)

MNIST1D, DIGITS, MNIST = (40,), (1, 8, 8), (1, 28, 28)


def test_builtin_names():
    assert MODELS == ("cnn1d", "cnn2d", "gpt", "mlp")


@pytest.mark.parametrize(
    ("name", "sample_shape", "batch_shape"),
    [
        ("mlp", MNIST1D, (5, 40)),
        ("mlp", DIGITS, (5, 1, 8, 8)),
        ("mlp", MNIST, (5, 1, 28, 28)),
        ("cnn1d", MNIST1D, (5, 40)),
        ("cnn1d", MNIST1D, (5, 1, 40)),
        ("cnn1d", (1, 40), (5, 1, 40)),
        ("cnn2d", DIGITS, (5, 1, 8, 8)),
        ("cnn2d", MNIST, (5, 1, 28, 28)),
        ("cnn2d", (8, 8), (5, 8, 8)),
        ("cnn2d", (3, 9, 13), (5, 3, 9, 13)),
    ],
)
def test_output_shape(name, sample_shape, batch_shape):
    model = build_model(name, sample_shape, 7)
    assert model(torch.randn(batch_shape)).shape == (5, 7)


def test_cnn1d_adds_channel_dimension():
    model = build_model("cnn1d", MNIST1D, 10)
    x = torch.randn(4, 40)
    torch.testing.assert_close(model(x), model(x.unsqueeze(1)))


def test_cnn1d_default_architecture_parameter_count():
    conv = 1 * 32 * 5 + 32 + 2 * (32 * 32 * 5 + 32)
    group_norm = 2 * 32
    head = 32 * 10 * 10 + 10  # 32 channels x length 40 / 4
    assert count_parameters(build_model("cnn1d", MNIST1D, 10)) == conv + group_norm + head


@pytest.mark.parametrize("name", ["mlp", "cnn1d", "cnn2d"])
def test_width_and_depth_change_the_model(name):
    shape = DIGITS if name == "cnn2d" else MNIST1D
    base = count_parameters(build_model(name, shape, 10))
    assert count_parameters(build_model(name, shape, 10, width=8)) < base
    assert count_parameters(build_model(name, shape, 10, depth=1)) < base
    deeper = build_model(name, shape, 10, width=8, depth=5)
    assert deeper(torch.randn(2, *shape)).shape == (2, 10)


def test_mlp_parameter_count_formula():
    model = build_model("mlp", MNIST1D, 10, width=16, depth=3)
    assert count_parameters(model) == (40 * 16 + 16) + 2 * (16 * 16 + 16) + (16 * 10 + 10)


@pytest.mark.parametrize(("width", "depth"), [(974, 2), (694, 3)])
def test_one_million_parameter_mlp(width, depth):
    n = count_parameters(build_model("mlp", MNIST1D, 10, width=width, depth=depth))
    assert abs(n - 1_000_000) / 1_000_000 < 0.01


@pytest.mark.parametrize(
    ("shape", "classes", "depth", "target"),
    [
        (MNIST1D, 10, 2, 1_000_000),
        (MNIST1D, 10, 3, 1_000_000),
        (MNIST, 10, 1, 100_000),
        (DIGITS, 10, 4, 250_000),
    ],
)
def test_mlp_width_for_params_hits_target(shape, classes, depth, target):
    width = mlp_width_for_params(shape, classes, depth, target)
    n = count_parameters(MLP(shape, classes, width=width, depth=depth))
    step = count_parameters(MLP(shape, classes, width=width + 1, depth=depth)) - n
    assert abs(n - target) <= step / 2 + 1
    assert abs(n - target) / target < 0.10


def test_count_parameters_skips_frozen():
    model = nn.Linear(4, 3)
    model.bias.requires_grad_(False)
    assert count_parameters(model) == 12


@pytest.mark.parametrize("name", MODELS)
def test_initialisation_is_deterministic(name):
    shape = DIGITS if name == "cnn2d" else MNIST1D
    states = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        states.append(build_model(name, shape, 10).state_dict())
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key], rtol=0, atol=0)
    assert any(not torch.equal(states[0][k], states[2][k]) for k in states[0])


@pytest.mark.parametrize(
    ("name", "shape"), [("mlp", MNIST1D), ("cnn1d", MNIST1D), ("cnn2d", DIGITS)]
)
def test_builtin_models_can_fit_a_small_batch(name, shape):
    torch.manual_seed(0)
    model = build_model(name, shape, 4)
    x, y = torch.randn(32, *shape), torch.randint(0, 4, (32,))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(150):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert (model(x).argmax(1) == y).float().mean().item() == 1.0


def test_builtin_classes_match_names():
    assert type(build_model("mlp", MNIST1D, 10)) is MLP
    assert type(build_model("cnn1d", MNIST1D, 10)) is CNN1d
    assert type(build_model("cnn2d", DIGITS, 10)) is CNN2d


# --- user models ----------------------------------------------------------------------------------

USER_MODULE = """
import math
from torch import nn

calls = []

def with_kwargs(input_shape, num_classes):
    calls.append(("with_kwargs", input_shape, num_classes))
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))

def no_args():
    calls.append(("no_args",))
    return nn.Linear(40, 3)

def only_classes(*, num_classes):
    return nn.Linear(40, num_classes)

def anything(**kwargs):
    calls.append(("anything", kwargs))
    return nn.Linear(40, kwargs["num_classes"])

def sized(input_shape, num_classes, width=4):
    return nn.Sequential(nn.Linear(input_shape[0], width), nn.Linear(width, num_classes))

def not_a_module():
    return [1, 2]

class Net(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(input_shape[0], num_classes)

    def forward(self, x):
        return self.fc(x)

not_callable = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"distrain_user_nets_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_user_factory_with_keywords(user_module):
    model = build_model(f"{user_module}:with_kwargs", (1, 8, 8), 10)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    assert sys.modules[user_module].calls == [("with_kwargs", (1, 8, 8), 10)]


def test_user_factory_without_arguments(user_module):
    model = build_model(f"{user_module}:no_args", (40,), 10)
    assert model(torch.randn(2, 40)).shape == (2, 3)
    assert sys.modules[user_module].calls == [("no_args",)]


def test_user_factory_gets_only_the_keywords_it_names(user_module):
    assert build_model(f"{user_module}:only_classes", (40,), 6).out_features == 6
    build_model(f"{user_module}:anything", (40,), 5)
    assert sys.modules[user_module].calls[-1] == (
        "anything",
        {"input_shape": (40,), "num_classes": 5},
    )


def test_user_class_and_width(user_module):
    assert isinstance(build_model(f"{user_module}:Net", (40,), 4), nn.Module)
    model = build_model(f"{user_module}:sized", (40,), 4, width=9)
    assert model[0].out_features == 9


def test_user_factory_is_deterministic(user_module):
    torch.manual_seed(3)
    a = build_model(f"{user_module}:with_kwargs", (40,), 10)
    torch.manual_seed(3)
    b = build_model(f"{user_module}:with_kwargs", (40,), 10)
    torch.testing.assert_close(a[1].weight, b[1].weight, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("attr", "setting", "fragment"),
    [
        ("missing", "--model", "has no attribute 'missing'"),
        ("not_a_module", "--model", "returned a list, not a torch.nn.Module"),
        ("not_callable", "--model", "is a int, not a callable"),
    ],
)
def test_user_factory_errors(user_module, attr, setting, fragment):
    with pytest.raises(ConfigError) as info:
        build_model(f"{user_module}:{attr}", (40,), 10)
    assert info.value.setting == setting
    assert fragment in str(info.value)


def test_user_factory_that_takes_no_width(user_module):
    with pytest.raises(ConfigError, match=r"^--model-width: .*takes no 'width' argument"):
        build_model(f"{user_module}:with_kwargs", (40,), 10, width=8)


def test_user_module_that_cannot_be_imported():
    with pytest.raises(
        ConfigError, match=r"^--model: cannot import module 'no_such_pkg_xyz\.nets'"
    ):
        build_model("no_such_pkg_xyz.nets:make", (40,), 10)


def test_unknown_model_lists_choices():
    with pytest.raises(ConfigError) as info:
        build_model("foo", (40,), 10)
    assert str(info.value) == (
        "--model: unknown model 'foo'; choose one of: cnn1d, cnn2d, gpt, mlp, or package.module:factory"
    )


@pytest.mark.parametrize("spec", [":make", "pkg.mod:"])
def test_malformed_factory_spec(spec):
    with pytest.raises(ConfigError, match="must look like package.module:factory"):
        build_model(spec, (40,), 10)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    ("key", "setting"), [("width", "--model-width"), ("depth", "--model-depth")]
)
@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_width_or_depth(name, key, setting, bad):
    shape = DIGITS if name == "cnn2d" else MNIST1D
    with pytest.raises(ConfigError) as info:
        build_model(name, shape, 10, **{key: bad})
    assert info.value.setting == setting
    assert "integer >= 1" in info.value.message


@pytest.mark.parametrize(("name", "shape"), [("cnn1d", (1, 8, 8)), ("cnn2d", (40,))])
def test_cnn_rejects_wrong_input_rank(name, shape):
    with pytest.raises(ConfigError, match=rf"^--model: {name} needs samples shaped"):
        build_model(name, shape, 10)


def test_mlp_width_for_params_formula_matches_depth_one():
    width = mlp_width_for_params((40,), 10, depth=1, target_params=5_010)
    assert width == math.floor((5_010 - 10) / (40 + 1 + 10))
