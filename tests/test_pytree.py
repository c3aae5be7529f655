"""recursively_apply, send_to_device, concatenate and the other pytree helpers, with HF Accelerate's semantics."""

from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from accel.pytree import (
    batch_rows,
    concatenate,
    concatenate_batches,
    find_batch_size,
    find_device,
    get_data_structure,
    get_shape,
    honor_type,
    ignorant_find_batch_size,
    initialize_tensors,
    listify,
    recursively_apply,
    replace_tensor_leaves,
    send_to_device,
    slice_tensors,
    tensor_leaves,
)

Point = namedtuple("Point", "x y")


class Encoding(dict):
    """Like transformers' BatchEncoding: a dict subclass with attribute access and its own `.to`."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device, non_blocking=False):
        return Encoding({key: value.to(device, non_blocking=non_blocking) for key, value in self.items()})


class Output(OrderedDict):
    """Like transformers' ModelOutput: an OrderedDict subclass without `.to`."""


class Movable:
    """Any object with a `.to` that does not accept `non_blocking`."""

    def __init__(self, device="cpu"):
        self.device = device

    def to(self, device):
        return Movable(device)


def _tree():
    return {
        "enc": Encoding(ids=torch.arange(4).view(2, 2), mask=torch.ones(2, 2, dtype=torch.bool)),
        "out": Output(logits=torch.zeros(2, 3), extra=[Point(torch.ones(2), "label")]),
        "seq": (torch.tensor(1.0), [torch.empty(0, 5)]),
        "name": "batch",
    }


def test_recursively_apply_keeps_every_container_type_and_other_leaves():
    result = recursively_apply(lambda t: t + 1, _tree())
    assert type(result["enc"]) is Encoding and result["enc"].ids.tolist() == [[1, 2], [3, 4]]
    assert type(result["out"]) is Output and list(result["out"]) == ["logits", "extra"]
    point = result["out"]["extra"][0]
    assert type(point) is Point and point.x.tolist() == [2.0, 2.0] and point.y == "label"
    assert type(result["seq"]) is tuple and result["seq"][0].item() == 2.0
    assert result["name"] == "batch"


def test_recursively_apply_passes_arguments_and_selects_leaves_with_test_type():
    result = recursively_apply(
        lambda x, a, b=0: x * a + b, [1, (2, 3.5), "s"], 10, b=1, test_type=lambda x: isinstance(x, int)
    )
    assert result == [11, (21, 3.5), "s"]


def test_recursively_apply_error_on_other_type_names_the_type():
    with pytest.raises(TypeError, match="<class 'str'>"):
        recursively_apply(torch.neg, {"a": torch.ones(1), "b": "text"}, error_on_other_type=True)


def test_tensor_leaves_follow_recursively_applys_order_and_rebuild():
    tree = _tree()
    del tree["name"]
    tree["out"]["extra"][0] = Point(torch.ones(2), torch.zeros(1))
    leaves = tensor_leaves(tree, "op")
    order = []
    recursively_apply(order.append, tree)
    assert [id(leaf) for leaf in leaves] == [id(leaf) for leaf in order] and len(leaves) == 7
    rebuilt = replace_tensor_leaves(tree, [leaf.float() * 0 for leaf in leaves])
    assert type(rebuilt["enc"]) is Encoding and type(rebuilt["out"]["extra"][0]) is Point
    assert all(leaf.eq(0).all() for leaf in tensor_leaves(rebuilt, "op"))
    with pytest.raises(TypeError, match="passed to `op`"):
        tensor_leaves({"a": 1}, "op")


def test_send_to_device_moves_tensors_and_objects_with_to():
    moved = send_to_device(_tree(), "meta")
    assert type(moved["enc"]) is Encoding and moved["enc"].ids.is_meta  # through Encoding.to
    assert moved["out"]["logits"].is_meta and moved["out"]["extra"][0].x.is_meta
    assert moved["seq"][1][0].is_meta and moved["name"] == "batch"
    assert send_to_device([Movable()], "meta", non_blocking=True)[0].device == "meta"  # .to without non_blocking


def test_send_to_device_skip_keys_are_honoured_even_where_the_mapping_has_to():
    tree = {"enc": Encoding(ids=torch.ones(1), keep=torch.ones(1)), "keep": torch.ones(1)}
    moved = send_to_device(tree, "meta", skip_keys="keep")
    assert moved["enc"].ids.is_meta and not moved["enc"].keep.is_meta and not moved["keep"].is_meta
    assert type(moved["enc"]) is Encoding


def test_concatenate_joins_matching_structures_leaf_by_leaf():
    parts = [
        {"x": torch.zeros(2, 3), "p": Point(torch.ones(1), torch.ones(2, 1))},
        {"x": torch.ones(1, 3), "p": Point(torch.zeros(2), torch.zeros(2, 1))},
    ]
    joined = concatenate(parts)
    assert joined["x"].shape == (3, 3) and joined["x"][2].eq(1).all()
    assert type(joined["p"]) is Point and joined["p"].x.tolist() == [1, 0, 0]
    assert concatenate([[torch.zeros(2, 1)], [torch.ones(2, 2)]], dim=1)[0].shape == (2, 3)
    enc = concatenate([Encoding(a=torch.ones(1)), Encoding(a=torch.zeros(1))])
    assert type(enc) is Encoding and enc.a.tolist() == [1, 0]
    assert concatenate(["only"]) == "only"
    with pytest.raises(TypeError, match="Can only concatenate tensors"):
        concatenate(["a", "b"])


def test_find_batch_size_and_its_errors():
    assert find_batch_size({"enc": Encoding(ids=torch.zeros(7, 2))}) == 7
    assert find_batch_size([(torch.zeros(3),), torch.zeros(9)]) == 3
    with pytest.raises(ValueError, match="empty"):
        find_batch_size({"a": []})
    with pytest.raises(TypeError, match="Can only find the batch size of tensors"):
        find_batch_size(["text"])
    assert ignorant_find_batch_size(["text"]) is None


def test_shape_structure_and_tensor_allocation_round_trip():
    tree = {"a": [torch.zeros(2, 3, dtype=torch.bfloat16)], "b": Point(torch.ones(()), 4)}
    assert get_shape(tree) == {"a": [[2, 3]], "b": Point([], 4)}
    allocated = initialize_tensors(get_data_structure(tree))
    assert allocated["a"][0].shape == (2, 3) and allocated["a"][0].dtype == torch.bfloat16
    assert allocated["b"].x.shape == () and allocated["b"].y == 4


def test_small_helpers():
    assert honor_type(Point(1, 2), iter([3, 4])) == Point(3, 4) and honor_type([1], iter((2,))) == [2]
    assert find_device(["x", {"a": torch.ones(1, device="meta")}]).type == "meta" and find_device(["x"]) is None
    assert slice_tensors({"a": torch.arange(5)}, slice(1, 3))["a"].tolist() == [1, 2]
    assert listify({"a": torch.tensor([1.5], dtype=torch.bfloat16), "b": torch.tensor(2)}) == {"a": [1.5], "b": 2}


def test_batch_helpers_differ_from_hfs_where_the_dispatcher_needs_it():
    assert batch_rows({"n": torch.tensor(3), "x": ["a", torch.zeros(5, 2)]}) == 5 and batch_rows(["text"]) == 0
    assert batch_rows([torch.zeros(0, 2), torch.zeros(4)]) == 0  # the first tensor with a dim decides
    joined = concatenate_batches([{"x": torch.ones(1), "tag": "a"}, {"x": torch.zeros(2), "tag": "b"}])
    assert joined["x"].tolist() == [1, 0, 0] and joined["tag"] == "a"
    sliced = slice_tensors({"scalar": torch.tensor(7), "rows": torch.arange(4)}, slice(1, 2))
    assert sliced["scalar"].item() == 7 and sliced["rows"].tolist() == [1]  # HF raises IndexError on the scalar


def test_mappings_that_cannot_be_built_from_a_dict_come_back_as_dicts():
    tree = defaultdict(list, {"a": torch.ones(1)})
    assert recursively_apply(torch.neg, tree) == {"a": torch.tensor([-1.0])}
    assert type(send_to_device(tree, "meta")) is dict
