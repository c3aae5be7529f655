"""The kept copy of sharded state for asynchronous saves (accel.checkpoint.shard_stager): a later save refreshes the
copy the first one made only while the live state is the same tensors, and what it returns always equals a copy
of torch's state dicts taken at that moment. Plain (unsharded) models: the stager treats a DTensor's local shard
as it treats a tensor, which tests/fsdp/test_async_sharded_save.py covers under FSDP2."""

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from accel.checkpoint.shard_stager import ShardStager


class Counted:
    """torch's trees for (model, optimizer), counting how often they were built."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.builds = model, optimizer, 0

    def __call__(self):
        self.builds += 1
        return [
            ("model", {"model": get_model_state_dict(self.model)}),
            ("optimizer", {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}),
        ]


def make(optimizer_class=torch.optim.AdamW, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    return model, optimizer_class(model.parameters(), lr=0.1, **options)


def step(model, optimizer, seed):
    torch.manual_seed(seed)
    model(torch.randn(6, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def stage(stager, model, optimizer, build):
    return stager.stage([model], [optimizer], build)


def assert_same_tree(staged, expected):
    if isinstance(expected, torch.Tensor):
        assert isinstance(staged, torch.Tensor) and torch.equal(staged, expected)
        assert staged.data_ptr() != expected.data_ptr()  # a copy, not the live tensor
    elif isinstance(expected, dict):
        assert set(staged) == set(expected)
        for key in expected:
            assert_same_tree(staged[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(staged) == len(expected)
        for item, reference in zip(staged, expected):
            assert_same_tree(item, reference)
    else:
        assert staged == expected


def test_a_later_save_of_the_same_state_refreshes_the_kept_copy_with_the_values_of_its_call():
    model, optimizer = make()
    build, stager = Counted(model, optimizer), ShardStager()
    step(model, optimizer, 1)
    first = stage(stager, model, optimizer, build)
    step(model, optimizer, 2)
    second = stage(stager, model, optimizer, build)
    assert build.builds == 1  # refreshed, not built anew
    assert second is first  # the kept copy, its tensors overwritten
    assert_same_tree(second, build())


def test_the_staged_copy_holds_the_state_of_its_call_while_training_goes_on():
    model, optimizer = make()
    build, stager = Counted(model, optimizer), ShardStager()
    step(model, optimizer, 1)
    stage(stager, model, optimizer, build)
    step(model, optimizer, 2)
    staged = stage(stager, model, optimizer, build)
    expected = [(name, {key: _cloned(tree) for key, tree in state.items()}) for name, state in build()]
    step(model, optimizer, 3)  # after the call: must not reach the copy
    assert_same_tree(staged, expected)


def test_a_scheduler_changed_learning_rate_is_taken_at_the_call():
    model, optimizer = make()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    build, stager = Counted(model, optimizer), ShardStager()
    step(model, optimizer, 1)
    stage(stager, model, optimizer, build)
    scheduler.step()
    staged = stage(stager, model, optimizer, build)
    assert build.builds == 1
    assert staged[1][1]["optimizer"]["param_groups"][0]["lr"] == 0.05


def test_a_parameter_over_new_memory_or_new_optimizer_state_builds_anew():
    model, optimizer = make()
    build, stager = Counted(model, optimizer), ShardStager()
    stage(stager, model, optimizer, build)  # before the first step: no optimizer state yet
    step(model, optimizer, 1)
    assert_same_tree(stage(stager, model, optimizer, build), build())
    assert build.builds == 3  # (the comparison built once more)
    model[2].bias.data = torch.ones(2)  # the same parameter over new memory, not what the copy came from
    staged = stage(stager, model, optimizer, build)
    assert build.builds == 4
    assert torch.equal(staged[0][1]["model"]["2.bias"], torch.ones(2))


def test_optimizer_state_that_is_not_a_tensor_is_compared_by_value():
    model, optimizer = make(torch.optim.SGD, momentum=0.9)
    optimizer.state[model[0].weight]["calls"] = 1  # a plain value in the state, as some optimizers keep
    build, stager = Counted(model, optimizer), ShardStager()
    step(model, optimizer, 1)
    stage(stager, model, optimizer, build)
    optimizer.state[model[0].weight]["calls"] = 2
    staged = stage(stager, model, optimizer, build)
    assert build.builds == 2
    assert staged[1][1]["optimizer"]["state"]["0.weight"]["calls"] == 2


def test_released_copy_is_built_anew():
    model, optimizer = make()
    build, stager = Counted(model, optimizer), ShardStager()
    step(model, optimizer, 1)
    stage(stager, model, optimizer, build)
    stager.release()
    stage(stager, model, optimizer, build)
    assert build.builds == 2


def _cloned(tree):
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(value) for value in tree)
    return tree


class Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight (GPT-2's wte and lm_head)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.out = torch.nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.embed(tokens))


def test_a_tied_weight_is_copied_once_and_both_names_hold_the_refreshed_copy():
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    build, stager = Counted(model, optimizer), ShardStager()

    def tied_step(seed):
        torch.manual_seed(seed)
        model(torch.randint(0, 5, (4,))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    tied_step(1)
    first = stage(stager, model, optimizer, build)[0][1]["model"]
    assert first["embed.weight"] is first["out.weight"]  # one copy under both names
    tied_step(2)
    staged = stage(stager, model, optimizer, build)
    assert build.builds == 1  # refreshed, not rebuilt
    assert staged[0][1]["model"]["out.weight"] is staged[0][1]["model"]["embed.weight"]
    assert_same_tree(staged, build())
