"""Graphs kept by mistake (ST004): a number, a tensor, a list or a dict that keeps the graphs of several steps or of an
evaluation, reported at the line that fills it with the holder and the memory named; the correct programs that look
alike (a regularisation term, a loss summed inside one call, GANs, rollouts backwarded later, create_graph,
retain_graph, metrics under no_grad) silent with the same numbers; and the out-of-memory note."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
import torch

from safetorch import GraphAccumulationWarning, _oom

from .conftest import clean_env, findings, lineno, on_and_off, run_runner, shows_safetorch


def net() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


X = torch.randn(64, 256)  # an activation of 64 kB: each forward saves one


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    loss = model(X).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def where(got: list) -> list[tuple[type, str, int]]:
    return [(w.category, w.filename, w.lineno) for w in got]


# --- found -----------------------------------------------------------------------------------------------------------


def test_a_list_of_losses_across_steps_is_found_at_the_append_naming_the_list() -> None:
    """rballester/tntorch#19: ``loss_history.append(loss)``."""
    model, opt = net()
    losses = []
    with findings() as got:
        for _ in range(4):
            losses.append(step(model, opt)); line = lineno()  # noqa: E702
    assert where(got) == [(GraphAccumulationWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST004 `losses.append(step(model, opt))` keeps the autograd graph of every tensor it "
                              "stores: `losses` (list, 2 items) holds 2 graphs across steps.")
    assert re.search(r"Their graphs hold \d+ autograd nodes \(a backward freed their saved tensors\)\.", message)
    assert message.endswith("Write: losses.append(step(model, opt).item()) (safetorch explain ST004)")


def test_a_dict_filled_every_step_with_unconsumed_graphs_is_found_with_their_bytes() -> None:
    model, opt = net()
    history: dict[int, torch.Tensor] = {}
    with findings() as got:
        for i in range(4):
            history[i] = model(X).sum(); line = lineno()  # noqa: E702  (a metric kept with its graph)
            step(model, opt)
    assert where(got) == [(GraphAccumulationWarning, __file__, line)]
    message = str(got[0].message)
    assert "`history` (dict, 2 items) holds 2 graphs across steps, that no backward has consumed." in message
    kept = 2 * 64 * 256 * 4  # each forward saved its ReLU output; the input X is shared
    assert f"Their graphs hold {(kept + X.numel() * 4) / 1000:.1f} kB of saved tensors" in message
    assert message.endswith("Write: history[i] = model(X).sum().item() (safetorch explain ST004)")


def test_a_list_attribute_of_a_trainer_is_named_as_such() -> None:
    class Trainer:
        def __init__(self) -> None:
            self.model, self.opt = net()
            self.outputs: list[dict[str, torch.Tensor]] = []

        def fit(self) -> int:
            for _ in range(3):
                loss = step(self.model, self.opt)
                self.outputs.append({"loss": loss})
            return lineno() - 1

    with findings() as got:
        line = Trainer().fit()
    assert where(got) == [(GraphAccumulationWarning, __file__, line)]
    assert "`self.outputs` (list, 2 items) holds 2 graphs across steps" in str(got[0].message)


def test_a_tensor_accumulator_is_found_at_its_line() -> None:
    model, opt = net()
    total = torch.zeros(())
    with findings() as got:
        for _ in range(4):
            loss = step(model, opt)
            total += loss; line = lineno()  # noqa: E702
    assert where(got) == [(GraphAccumulationWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST004 `total += loss` adds a tensor that requires grad to the tensor `total`: it keeps "
                              "the autograd graph of every step it sums, and no backward goes through it.")
    assert message.endswith("Write: total += loss.item() (safetorch explain ST004)")


def test_a_tensor_accumulator_rebound_to_a_new_sum_is_found_at_its_line() -> None:
    """``total = total + loss``: each step makes a new tensor, whose graph holds the sum before it."""
    model, opt = net()
    total = torch.zeros(())
    with findings() as got:
        for _ in range(4):
            loss = step(model, opt)
            total = total + loss; line = lineno()  # noqa: E702
    assert where(got) == [(GraphAccumulationWarning, __file__, line)]
    message = str(got[0].message)
    assert message.startswith("ST004 `total = total + loss` adds a tensor that requires grad to the tensor `total`: "
                              "it keeps the autograd graph of every step it sums, and no backward goes through it.")
    assert message.endswith("Write: total = total + loss.item() (safetorch explain ST004)")


def test_a_running_average_of_the_loss_that_keeps_its_graph_is_found() -> None:
    model, opt = net()
    smooth = torch.zeros(())
    with findings() as got:
        for _ in range(4):
            loss = step(model, opt)
            smooth = 0.9 * smooth + 0.1 * loss; line = lineno()  # noqa: E702
    assert where(got) == [(GraphAccumulationWarning, __file__, line)]


def test_a_tensor_accumulator_summed_before_backward_is_found() -> None:
    model, opt = net()
    total = torch.zeros(())
    with findings() as got:
        for _ in range(4):
            loss = model(X).pow(2).mean()
            total += loss; line = lineno()  # noqa: E702
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert where(got) == [(GraphAccumulationWarning, __file__, line)]
    assert "of saved tensors" not in str(got[0].message)  # the losses' own graphs were consumed: nodes only


def validate(model: torch.nn.Module) -> torch.Tensor:
    total = 0.0
    for _ in range(5):
        total += model(X).pow(2).mean()  # a validation loop in training mode, without no_grad
    return total / 5  # type: ignore[return-value]


VALIDATE_LINE = validate.__code__.co_firstlineno + 3


def test_a_sum_in_a_loop_with_no_backward_is_found_when_training_goes_on() -> None:
    model, opt = net()
    with findings() as got:
        step(model, opt)
        val_loss = validate(model)
        for _ in range(3):
            step(model, opt)
        assert got == []  # a GAN may sum a loss before another backward: three backwards are not yet evidence
        step(model, opt)
    assert where(got) == [(GraphAccumulationWarning, __file__, VALIDATE_LINE)]
    message = str(got[0].message)
    assert "`val_loss` (a tensor) holds it now." in message
    kept = 5 * (64 * 256 + 64) * 4 + X.numel() * 4  # per forward its ReLU output and pow's input; the shared input
    assert f"Its graph holds {kept / 1000:.1f} kB of saved tensors" in message
    if sys.version_info >= (3, 11):  # 3.10 has no columns: its message names only what the bytecode proves
        assert message.endswith("Write: total += model(X).pow(2).mean().item() (safetorch explain ST004)")
    assert val_loss.grad_fn is not None  # only reported


def collect(model: torch.nn.Module, criterion: Any, batches: int) -> float:
    """A validation in training mode without no_grad, on a model with neither dropout nor BatchNorm: each batch's
    loss kept in a list until the mean is taken."""
    losses = []
    for _ in range(batches):
        losses.append(criterion(model(X), torch.zeros(64, 1)))
    return float(sum(losses) / len(losses))


COLLECT_LINE = collect.__code__.co_firstlineno + 5


def test_a_list_an_evaluation_fills_between_steps_is_found_when_its_graphs_die_unused() -> None:
    model, opt = net()
    criterion = torch.nn.MSELoss()
    with findings() as got:
        step(model, opt)
        collect(model, criterion, 6)
        assert got == []  # its graphs died unused as the function returned: noted, reported at the next backward
        step(model, opt)
    assert where(got) == [(GraphAccumulationWarning, __file__, COLLECT_LINE)]
    message = str(got[0].message)
    assert message.startswith("ST004 `losses.append(criterion(model(X), torch.zeros(64, 1)))` keeps the autograd "
                              "graph of every tensor it stores: `losses` (list, ")
    assert "items when seen) holds" in message and "graphs or more across iterations" in message
    assert message.endswith("Write: losses.append(criterion(model(X), torch.zeros(64, 1)).item()) "
                            "(safetorch explain ST004)")


def test_an_evaluation_at_the_end_of_a_program_is_found_at_exit(tmp_path: Any) -> None:
    script = tmp_path / "evaluate.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))\n"
        "outputs = []\n"
        "for _ in range(8):\n"
        "    x = torch.randn(4, 16)\n"
        "    out = model(x)\n"
        "    outputs.append(out)\n"
        "    print(float(torch.nn.functional.mse_loss(out, torch.zeros(4, 1))))\n")
    result = run_runner([str(script)], cwd=str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert re.search(rf"^{re.escape(str(script))}:8: GraphAccumulationWarning: ST004 `outputs.append\(out\)` keeps "
                     r"the autograd graph of every tensor it stores: `outputs` \(list, \d+ items when seen\) holds \d+ "
                     r"graphs or more across iterations, that no backward has consumed\. .* "
                     r"Write: outputs\.append\(out\.detach\(\)\)", result.stderr, re.M), result.stderr


def rollout_with_a_loss_per_step() -> list[torch.Tensor]:
    """A rollout computing a loss per step, kept in a list and backwarded at the episode's end: consumed."""
    model, opt = net()
    out = []
    for _ in range(3):
        terms = []
        for _ in range(6):
            terms.append(torch.nn.functional.mse_loss(model(X), torch.zeros(64, 1)))
        opt.zero_grad()
        torch.stack(terms).sum().backward()
        opt.step()
        out.append(torch.stack(terms).detach())
    return out


def test_a_rollout_whose_losses_are_backwarded_later_is_silent() -> None:
    got, same = on_and_off(rollout_with_a_loss_per_step)
    assert [str(w.message) for w in got] == [] and same


def test_a_sum_kept_in_scope_through_training_is_found() -> None:
    model, opt = net()
    with findings() as got:
        total = 0.0
        for _ in range(4):
            total += model(X).pow(2).mean(); line = lineno()  # noqa: E702
        for _ in range(4):
            step(model, opt)
    assert where(got) == [(GraphAccumulationWarning, __file__, line)]
    assert isinstance(total, torch.Tensor)


# --- silent ----------------------------------------------------------------------------------------------------------


def regularised() -> list[torch.Tensor]:
    """An L2 term built each step, its variable alive after its loop, in a step with two backwards."""
    model, opt = net()
    critic = torch.nn.Linear(1, 1)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
    out = []
    l2 = 0.0
    for _ in range(4):
        l2 = 0.0
        for p in model.parameters():
            l2 += p.pow(2).sum()
        pred = model(X)
        loss = pred.pow(2).mean() + 1e-4 * l2
        opt.zero_grad()
        loss.backward()
        opt.step()
        c_loss = critic(pred.detach()).pow(2).mean()
        opt_c.zero_grad()
        c_loss.backward()
        opt_c.step()
        out.append(loss.detach())
    out.append(l2.detach())  # type: ignore[union-attr]
    return out


class MultiResolutionSTFTLoss(torch.nn.Module):
    """kan-bayashi/ParallelWaveGAN#26's loss: spectral convergence and log magnitude, summed over resolutions in one
    call (``sc_loss = 0.0; sc_loss += ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.resolutions = [(64, 16, 64), (128, 32, 128), (32, 8, 32)]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sc_loss = 0.0
        mag_loss = 0.0
        for fft, hop, win in self.resolutions:
            window = torch.hann_window(win)
            xs = torch.stft(x, fft, hop, win, window, return_complex=True).abs().clamp(min=1e-7)
            ys = torch.stft(y, fft, hop, win, window, return_complex=True).abs().clamp(min=1e-7)
            sc_loss += torch.norm(ys - xs, p="fro") / torch.norm(ys, p="fro")
            mag_loss += torch.nn.functional.l1_loss(torch.log(ys), torch.log(xs))
        sc_loss /= len(self.resolutions)
        mag_loss /= len(self.resolutions)
        return sc_loss, mag_loss  # type: ignore[return-value]


def parallel_wavegan() -> list[torch.Tensor]:
    """A GAN step with two backwards and two optimizers: the generator's loss is the STFT loss plus an adversarial
    term; the discriminator's backward comes after."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 512))
    discriminator = torch.nn.Sequential(torch.nn.Linear(512, 64), torch.nn.LeakyReLU(0.2), torch.nn.Linear(64, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-4)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-4)
    stft_loss = MultiResolutionSTFTLoss()
    out = []
    for _ in range(5):
        z, y = torch.randn(4, 32), torch.randn(4, 512)
        y_ = generator(z)
        sc_loss, mag_loss = stft_loss(y_, y)
        gen_loss = sc_loss + mag_loss + 4.0 * (1 - discriminator(y_)).pow(2).mean()
        opt_g.zero_grad()
        gen_loss.backward()
        opt_g.step()
        dis_loss = (1 - discriminator(y)).pow(2).mean() + discriminator(y_.detach()).pow(2).mean()
        opt_d.zero_grad()
        dis_loss.backward()
        opt_d.step()
        out += [gen_loss.detach(), dis_loss.detach(), sc_loss.detach()]
    return out


def generator_loss_summed_before_the_critics_backward() -> list[torch.Tensor]:
    """The generator's loss summed over its terms (``g_loss = 0.0; g_loss += w * term``) before the critic's
    backward and step, and backwarded after them."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    critic = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    features = torch.nn.Linear(256, 64).requires_grad_(False)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-4)
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-4)
    out = []
    for _ in range(6):
        z, real = torch.randn(64, 16), torch.randn(64, 256)
        fake = generator(z)
        g_loss = 0.0
        terms = [(1.0, (fake - real).abs().mean()), (0.1, (features(fake) - features(real)).pow(2).mean()),
                 (1e-3, fake.pow(2).mean())]
        for weight, term in terms:
            g_loss += weight * term
        c_loss = critic(fake.detach()).mean() - critic(real).mean()
        opt_c.zero_grad()
        c_loss.backward()
        opt_c.step()
        opt_g.zero_grad()
        g_loss.backward()  # type: ignore[union-attr]
        opt_g.step()
        out += [c_loss.detach(), g_loss.detach()]  # type: ignore[union-attr]
    return out


def reinforce() -> list[torch.Tensor]:
    """Rollouts whose log-probabilities are collected in a list and backwarded later, every episode; the list is
    cleared in place (pytorch/examples' reinforce) or made anew."""
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    saved: list[torch.Tensor] = []
    out = []
    for episode in range(6):
        fresh: list[torch.Tensor] = []
        for _ in range(5):
            probs = torch.softmax(policy(torch.randn(1, 4)), -1)
            dist = torch.distributions.Categorical(probs)
            action = dist.sample()
            (saved if episode % 2 else fresh).append(dist.log_prob(action))
        log_probs = saved if episode % 2 else fresh
        loss = -torch.stack(log_probs).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        del saved[:]
        out.append(loss.detach())
    return out


def gradient_penalty() -> list[torch.Tensor]:
    """create_graph: a penalty on the input gradient (WGAN-GP), summed over its parts with ``gp += ...``."""
    model, opt = net()
    out = []
    for _ in range(4):
        x = X.clone().requires_grad_(True)
        pred = model(x)
        (grad,) = torch.autograd.grad(pred.sum(), x, create_graph=True)
        gp = 0.0
        for part in grad.split(32):
            gp += (part.norm(2, dim=1) - 1).pow(2).mean()
        loss = pred.mean() + 10 * gp
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return out


def retained() -> list[torch.Tensor]:
    """retain_graph training: two losses from one forward, kept in a list for the step, each backwarded."""
    model, opt = net()
    out = []
    for _ in range(4):
        pred = model(X)
        parts = [pred.pow(2).mean(), pred.abs().mean()]
        opt.zero_grad()
        parts[0].backward(retain_graph=True)
        parts[1].backward()
        opt.step()
        out += [p.detach() for p in parts]
    return out


def metrics_without_grad() -> list[torch.Tensor]:
    model, opt = net()
    total = 0.0
    kept: list[torch.Tensor] = []
    history = torch.zeros(())
    for _ in range(4):
        step(model, opt)
        with torch.no_grad():
            val = model(X).pow(2).mean()
            total += val
            history += val
            kept.append(val)
    return [torch.as_tensor(total), history, *kept]


def rebound_sums_within_a_step() -> list[torch.Tensor]:
    """``acc = acc + x`` made anew each step: micro-batches summed for one backward, a penalty, a detached average."""
    model, opt = net()
    smooth = torch.zeros(())
    out = []
    for _ in range(4):
        acc = torch.zeros(())
        for chunk in X.split(16):
            acc = acc + model(chunk).pow(2).mean()
        penalty = torch.zeros(())
        for p in model.parameters():
            penalty = penalty + p.pow(2).sum()
        loss = acc + 1e-4 * penalty
        opt.zero_grad()
        loss.backward()
        opt.step()
        smooth = 0.9 * smooth + 0.1 * loss.detach()
        out.append(smooth)
    return out


@pytest.mark.parametrize("program", [regularised, rebound_sums_within_a_step, parallel_wavegan,
                                     generator_loss_summed_before_the_critics_backward,
                                     reinforce, gradient_penalty, retained, metrics_without_grad])
def test_look_alikes_are_silent_with_the_same_numbers(program) -> None:  # type: ignore[no-untyped-def]
    got, same = on_and_off(program)
    assert [str(w.message) for w in got] == []
    assert same


# --- the out-of-memory note ------------------------------------------------------------------------------------------


def test_the_note_names_the_holders_their_lines_and_bytes() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    losses = []
    line = [0]

    def run() -> None:
        for i in range(3):
            losses.append(model(X).sum()); line[0] = lineno()  # noqa: E702
            if i == 2:
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                   "memory: you tried to allocate 524288 bytes. Error code 12 (Cannot allocate memory)")

    with pytest.raises(RuntimeError) as info:
        run()
    note = _oom.note(info.value)
    assert note is not None
    head, *rest = note.splitlines()
    kept = f"{(3 * 64 * 256 * 4 + X.numel() * 4) / 1000:.1f} kB"
    counted = re.fullmatch(r"safetorch: memory ran out with (\d+) autograd graphs alive that no backward has "
                           r"consumed, holding ([\d.]+) kB of saved tensors\.", head)
    assert counted is not None, head  # every such graph of this process: those of the three losses at least
    assert int(counted[1]) >= 3 and float(counted[2]) >= float(kept.split()[0])
    assert rest[0] == (f"  `losses` (list, 3 items), filled at {__file__}:{line[0]} (`losses.append(model(X).sum())`), "
                       f"holds {kept}. Write: losses.append(model(X).sum().item())")
    assert "with torch.no_grad()" in rest[-1]


def test_no_note_for_another_error_and_one_for_a_gpus() -> None:
    kept = [torch.randn(3, requires_grad=True) * 2]
    assert _oom.note(RuntimeError("Expected all tensors to be on the same device")) is None
    assert _oom.note(ValueError("DefaultCPUAllocator: can't allocate memory")) is None
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert _oom.is_out_of_memory(gpu)
    note = _oom.note(gpu)
    assert note is not None and note.startswith("safetorch: memory ran out with ")
    assert kept


# --- end to end: a program that runs out of memory, under an address-space limit --------------------------------------

PROGRAM = """\
import resource
import torch


def address_space() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
criterion = torch.nn.CrossEntropyLoss()
x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
resource.setrlimit(resource.RLIMIT_AS, (address_space() + 300 * 2**20, resource.RLIM_INFINITY))


def validate():
    {start}
    for step in range(100000):
        {fill}
    return {name}


validate()
"""
FILL_LINE = PROGRAM.splitlines().index("        {fill}") + 1

SHAPES = {
    "list": ("losses = []", "losses.append(criterion(model(x), y))", "losses",
             "`losses` (list, {n} items)", "losses.append(criterion(model(x), y).item())"),
    "number": ("total = 0.0", "total += criterion(model(x), y)", "total",
               "`total` (a tensor, the sum of {n} graphs)", "total += criterion(model(x), y).item()"),
    "tensor": ("total = torch.zeros(())", "total += criterion(model(x), y)", "total",
               "`total` (a tensor, the sum of {n} graphs)", "total += criterion(model(x), y).item()"),
    "rebound": ("total = torch.zeros(())", "total = total + criterion(model(x), y)", "total",
                "`total` (a tensor, the sum of {n} graphs)", "total = total + criterion(model(x), y).item()"),
    "dict": ("outputs = {}", "outputs[step] = model(x)", "outputs",
             "`outputs` (dict, {n} items)", "outputs[step] = model(x).detach()"),
}


SLOW = [pytest.param(s, marks=pytest.mark.slow) for s in sorted(SHAPES) if s != "list"]  # a subprocess each, twice


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the note is a PEP 678 exception note (3.11+)")
@pytest.mark.parametrize("shape", ["list", *SLOW])
def test_out_of_memory_carries_the_note_naming_the_line_and_the_holder(shape: str, tmp_path: Any) -> None:
    start, fill, name, holder, fix = SHAPES[shape]
    script = tmp_path / "validate.py"
    script.write_text(PROGRAM.format(start=start, fill=fill, name=name))
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                           env=clean_env(), cwd=tmp_path)
    assert "DefaultCPUAllocator: can't allocate memory" in plain.stderr and not shows_safetorch(plain.stderr)
    result = run_runner([str(script)], cwd=str(tmp_path))
    assert result.returncode == 1
    assert "DefaultCPUAllocator: can't allocate memory" in result.stderr
    note = re.search(r"^safetorch: memory ran out with (\d+) autograd graphs? alive that no backward has consumed, "
                     r"holding ([\d.]+) MB of saved tensors\.$", result.stderr, re.M)
    assert note is not None, result.stderr
    assert int(note[1]) >= (1 if shape in ("number", "tensor", "rebound") else 100) and float(note[2]) > 50
    pattern = re.escape(holder).replace(re.escape("{n}"), r"(\d+)")
    named = re.search(rf"^  {pattern}, filled at {re.escape(str(script))}:{FILL_LINE} \(`{re.escape(fill)}`\), "
                      rf"holds ([\d.]+) MB\. Write: {re.escape(fix)}$", result.stderr, re.M)
    assert named is not None, result.stderr
    assert int(named[1]) >= 100 and float(named[2]) > 50


EVALUATION_SCRIPT = """\
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
criterion = torch.nn.CrossEntropyLoss()
total = 0.0
for _ in range(5):  # an evaluation script in training mode, without no_grad: no backward at all
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    total += criterion(model(x), y)
print(f"{float(total) / 5:.4f}")
"""


def test_a_sum_in_a_program_with_no_backward_at_all_is_found_at_exit(tmp_path: Any) -> None:
    script = tmp_path / "evaluate.py"
    script.write_text(EVALUATION_SCRIPT)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                           env=clean_env(), cwd=tmp_path)
    result = run_runner([str(script)], cwd=str(tmp_path))
    assert result.returncode == 1 and result.stdout == plain.stdout  # the same number printed; 1: a finding
    line = EVALUATION_SCRIPT.splitlines().index("    total += criterion(model(x), y)") + 1
    kept = 5 * (64 * 256 * 4 * 2 + 64 * 10 * 4 + 64 * 8)  # per batch: x, ReLU and log-softmax outputs, y
    assert f"{script}:{line}: GraphAccumulationWarning: ST004 " in result.stderr
    if sys.version_info >= (3, 11):  # 3.10 has no columns: its message names only what the bytecode proves
        assert (f"{script}:{line}: GraphAccumulationWarning: ST004 total += criterion(model(x), y) adds a tensor "
                "that requires grad to a Python number") in result.stderr
    assert f"Its graph holds {kept / 1000:.1f} kB of saved tensors" in result.stderr


CUDA_PROGRAM = """\
import torch

torch.manual_seed(0)
torch.cuda.set_per_process_memory_fraction(2 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
criterion = torch.nn.CrossEntropyLoss()
x, y = torch.randn(1024, 1024, device="cuda"), torch.randint(0, 10, (1024,), device="cuda")


def validate():
    losses = []
    for step in range(100000):
        losses.append(criterion(model(x), y))
    return losses


validate()
"""


@pytest.mark.skipif(not torch.cuda.is_available() or sys.version_info < (3, 11),
                    reason="needs a CUDA device (bench/gpu.sh runs it); the note is a PEP 678 note (3.11+)")
def test_a_cuda_out_of_memory_note_names_the_holder_and_memory_allocated(tmp_path: Any) -> None:
    """The seed's error itself: ``torch.OutOfMemoryError`` on a GPU, capped at 2 GiB, carries the note with the line,
    the holder and what the allocator holds."""
    script = tmp_path / "validate_cuda.py"
    script.write_text(CUDA_PROGRAM)
    result = run_runner([str(script)], cwd=str(tmp_path))
    assert result.returncode == 1
    assert "torch.OutOfMemoryError" in result.stderr or "CUDA out of memory" in result.stderr
    line = CUDA_PROGRAM.splitlines().index("        losses.append(criterion(model(x), y))") + 1
    assert re.search(rf"^  `losses` \(list, \d+ items\), filled at {re.escape(str(script))}:{line} ", result.stderr,
                     re.M), result.stderr
    assert re.search(r"^  torch\.cuda\.memory_allocated\(\) = [\d.]+ [kMG]B\.$", result.stderr, re.M), result.stderr
