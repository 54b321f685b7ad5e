"""The same vanilla RNN trained by backpropagation through time (SGD or Adam, autograd).

Full-batch, like the ADMM iterations, so one iteration means one pass over the training set for
every method. Each iteration also records how the gradient of the loss with respect to the hidden
state s_t changes along the sequence: |dL/ds_t| for every t and the ratio first/last step. With a
loss on the last step only (digits), a ratio far below 1 is a vanishing gradient and far above 1
an exploding one; with a loss on every step (language model) each s_t also gets a direct term, so
the ratio is a weaker signal there.
"""

from __future__ import annotations

import time

import torch

from traces.errors import ConfigError

from .data import SequenceData
from .rnn_admm import RNNParams, evaluate, init_params


def _loss_and_states(params: dict[str, torch.Tensor],
                     data: SequenceData) -> tuple[torch.Tensor, list[torch.Tensor]]:
    s = data.x.new_zeros(data.samples, params["W"].shape[0])
    states = []
    for x_t in data.x:
        s = torch.tanh(x_t @ params["U"].T + s @ params["W"].T + params["b"])
        s.retain_grad()
        states.append(s)
    logits = torch.stack([states[t] for t in data.out_steps]) @ params["V"].T + params["c"]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, data.num_classes), data.y.reshape(-1))
    return loss, states


def train_gradient(
    train: SequenceData,
    hidden: int,
    iterations: int,
    optimizer: str = "adam",
    lr: float = 0.01,
    seed: int = 0,
    validation: SequenceData | None = None,
    clip: float | None = None,
    init_scale: float = 1.0,
) -> tuple[RNNParams, list[dict[str, float]]]:
    """SGD or Adam on the mean cross-entropy; same initialization as ADMMiRNN for the same seed
    and ``init_scale``. History columns as :func:`exec.admm.rnn_admm.train_admm`'s plus the
    gradient-health measures of every iteration's backward pass."""
    init = init_params(train.input_dim, hidden, train.num_classes, seed, train.x.dtype, init_scale)
    params = {k: v.clone().requires_grad_(True) for k, v in vars(init).items()}
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params.values(), lr=lr)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(params.values(), lr=lr)
    else:
        raise ConfigError("optimizer", f"unknown optimizer {optimizer!r}", "use 'sgd' or 'adam'")
    history: list[dict[str, float]] = []
    elapsed = 0.0
    for it in range(iterations + 1):
        start = time.perf_counter()
        opt.zero_grad()
        loss, states = _loss_and_states(params, train)
        loss.backward()
        # gradient-health measures of this iteration's backward pass
        state_grads = [float(s.grad.norm()) for s in states]
        weight_grad = float(params["W"].grad.norm())
        if it > 0:  # row 0 describes the initial weights, like the ADMM history
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params.values(), clip)
            opt.step()
            elapsed += time.perf_counter() - start
        current = RNNParams(**{k: v.detach() for k, v in params.items()})
        row = {"iteration": it, "time_s": elapsed, "grad_W_norm": weight_grad,
               "grad_ratio_first_last": state_grads[0] / max(state_grads[-1], 1e-300)}
        row.update({f"grad_s{t + 1}": g for t, g in enumerate(state_grads)})
        row["train_loss"], row["train_acc"] = evaluate(current, train)
        if validation is not None:
            row["val_loss"], row["val_acc"] = evaluate(current, validation)
        history.append(row)
    return RNNParams(**{k: v.detach().clone() for k, v in params.items()}), history


def gradient_health(params: RNNParams, data: SequenceData) -> dict[str, float]:
    """The BPTT gradient measures of any weights (also ADMM's, which never backpropagate):
    |dL/ds_t| per step, their ratio first/last step and |dL/dW|, for the mean cross-entropy."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in vars(params).items()}
    loss, states = _loss_and_states(leaves, data)
    loss.backward()
    state_grads = [float(s.grad.norm()) for s in states]
    row = {"grad_W_norm": float(leaves["W"].grad.norm()),
           "grad_ratio_first_last": state_grads[0] / max(state_grads[-1], 1e-300)}
    return row | {f"grad_s{t + 1}": g for t, g in enumerate(state_grads)}
