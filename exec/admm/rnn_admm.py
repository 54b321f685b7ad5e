"""ADMMiRNN: ADMM training of an unfolded vanilla RNN (Tang et al., ECML-PKDD 2020; arXiv 2006.05622).

The RNN, row-vector convention (one sample per row, N samples, T steps)::

    a_t = x_t U^T + s_{t-1} W^T + b,   s_t = tanh(a_t),   o_t = s_t V^T + c,   s_0 = 0

Every equality of the unfolded network becomes a constraint with its own dual variable and
penalty, giving the augmented Lagrangian (sums over samples and steps; R is the cross-entropy of
the outputs o_t on the steps that carry a target)::

    L = R(o) + sum_t <lam_a_t, r_a_t> + rho_a/2 |r_a_t|^2      r_a_t = a_t - x_t U^T - s_{t-1} W^T - b
             + sum_t <lam_s_t, r_s_t> + rho_s/2 |r_s_t|^2      r_s_t = s_t - tanh(a_t)
             + sum_t <lam_o_t, r_o_t> + rho_o/2 |r_o_t|^2      r_o_t = o_t - s_t V^T - c

One iteration updates the blocks in the paper's order, each with all others fixed:

    U, W  linearized proximal step (one gradient step with step 1/Lipschitz of the quadratic)
    b     closed form (mean residual)
    a     closed form after a first-order expansion of tanh around the current a (plus a prox term)
    s     closed form: a small H x H linear system per step (s_t appears in r_s_t, r_o_t, r_a_{t+1})
    V     linearized proximal step;  c  closed form
    o     a few gradient steps on cross-entropy + rho_o/2 |o - target|^2 (no closed form for
          cross-entropy; the sub-problem is rho_o-strongly convex and (rho_o + 1/2)-smooth, so
          steps of 1/(rho_o + 1/2) converge linearly)
    lam   dual ascent lam += rho * r for the three constraints

Because the U/W/b and V/c sub-problems are least squares, they depend on the data only through
sufficient statistics (Gram matrices ``Z^T Z`` and ``Z^T Y``). Those are sums over samples, so a
data-parallel run sums them across ranks (one all-reduce per parameter group) and then takes
exactly the serial step: ``reduce`` below is the identity in the serial algorithm and an
all-reduce in SP-ADMMiRNN. No autograd anywhere in this file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from traces.errors import ConfigError

from .data import SequenceData

Reduce = Callable[[torch.Tensor], torch.Tensor]


def no_reduce(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class RNNParams:
    """Weights of the vanilla RNN. U: (H, D), W: (H, H), b: (H,), V: (K, H), c: (K,)."""

    U: torch.Tensor
    W: torch.Tensor
    b: torch.Tensor
    V: torch.Tensor
    c: torch.Tensor

    def flat(self) -> torch.Tensor:
        return torch.cat([getattr(self, f.name).reshape(-1) for f in fields(self)])

    def load_flat(self, flat: torch.Tensor) -> RNNParams:
        """A copy with values taken from ``flat`` (the layout of :meth:`flat`)."""
        out, offset = {}, 0
        for f in fields(self):
            ref = getattr(self, f.name)
            out[f.name] = flat[offset : offset + ref.numel()].reshape(ref.shape).clone()
            offset += ref.numel()
        return RNNParams(**out)

    def clone(self) -> RNNParams:
        return RNNParams(**{f.name: getattr(self, f.name).clone() for f in fields(self)})


def init_params(input_dim: int, hidden: int, classes: int, seed: int = 0,
                dtype: torch.dtype = torch.float64, init_scale: float = 1.0) -> RNNParams:
    """Uniform(-1/sqrt(H), 1/sqrt(H)) for every weight and bias, as torch.nn.RNN initializes,
    times ``init_scale`` (the robustness-to-initialisation sweep; 1 is torch's default)."""
    if not init_scale > 0:
        raise ConfigError("init_scale", f"{init_scale} is not positive", "use a positive factor, e.g. 1")
    gen = torch.Generator().manual_seed(seed)
    bound = init_scale * hidden ** -0.5

    def draw(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen, dtype=dtype) * 2 - 1) * bound

    return RNNParams(draw(hidden, input_dim), draw(hidden, hidden), draw(hidden),
                     draw(classes, hidden), draw(classes))


def forward(params: RNNParams, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pre-activations a, states s (both (T, N, H)) and outputs o on every step (T, N, K)."""
    states, pre = [], []
    s = x.new_zeros(x.shape[1], params.W.shape[0])
    for x_t in x:
        a = x_t @ params.U.T + s @ params.W.T + params.b
        s = torch.tanh(a)
        pre.append(a)
        states.append(s)
    a_all, s_all = torch.stack(pre), torch.stack(states)
    return a_all, s_all, s_all @ params.V.T + params.c


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over all leading positions of -log softmax(logits)[target]."""
    logp = torch.log_softmax(logits, dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).sum()


def evaluate(params: RNNParams, data: SequenceData) -> tuple[float, float]:
    """Mean cross-entropy per target and accuracy of a plain forward pass."""
    _, _, o = forward(params, data.x)
    logits = o[list(data.out_steps)]
    count = data.y.numel()
    loss = float(cross_entropy_sum(logits, data.y)) / count
    acc = float((logits.argmax(-1) == data.y).sum()) / count
    return loss, acc


@dataclass(frozen=True)
class ADMMConfig:
    """Penalties, proximal weights, block order and inner-step settings.

    rho_* weigh the three constraint families; with the loss summed over samples they are per-
    sample weights and do not depend on the batch size. ``theta_a`` is the prox weight that keeps
    the a-step near the point where tanh was linearized. ``prox_scale`` >= 1 multiplies the
    Lipschitz constant in the linearized weight steps. ``theta_w`` adds a fixed proximal weight
    (per row of the statistics) to those steps: the paper's linearized update has such a term
    (its tau; the authors' code uses a fixed tao = 1). Without it the step is 1/Lipschitz of the
    current Gram matrix, which is unbounded when the auxiliary states are small: from a x0.01
    initialisation V jumps in one iteration to O(1/|s|) and training falls into a degenerate
    point where tiny s and huge V fit the labels (Lagrangian -> 0, forward-pass loss -> 20+; see
    docs/admm.md). ``weight_decay`` is the paper's regularizer Omega = nu/2 |U|^2 + |W|^2 + |V|^2
    (per row; 0 = none).

    ``reanchor``: at the start of every iteration reset a, s, o to the forward pass of the current
    weights (the duals are kept). The authors' public code does this (it recomputes a, s, o with
    its BPTT forward pass every iteration); it keeps the auxiliary variables from drifting to a
    solution of the constraints that the weights' forward pass does not reproduce.

    ``sweep``: the block order of one iteration.
    ``forward`` (the paper's Algorithm: U, W, b, a, s, V, c, o, duals);
    ``backward-forward`` (the authors' code: o, V, c, s, a, then the forward order);
    ``local-first`` (a, s, o, duals, then U, W, b and V, c from one set of statistics): the order
    of AP-ADMMiRNN, where a worker updates its samples and the server then updates the weights, so
    that one worker round trip per iteration suffices.

    Defaults: chosen on a validation split carved from the training set (digits, 300
    iterations; Shakespeare, 100), by ``analysis/admm_tuning.py``; see docs/admm.md.
    """

    rho_a: float = 10.0
    rho_s: float = 10.0
    rho_o: float = 0.1
    theta_a: float = 1.0
    prox_scale: float = 1.0
    o_steps: int = 10
    theta_w: float = 0.03
    weight_decay: float = 0.0
    reanchor: bool = True
    sweep: str = "backward-forward"

    def __post_init__(self) -> None:
        if self.sweep not in SWEEPS:
            raise ConfigError("sweep", f"unknown block order {self.sweep!r}", f"use one of {', '.join(SWEEPS)}")
        for name in ("rho_a", "rho_s", "rho_o"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"{getattr(self, name)} is not positive", "use a positive penalty")
        for name in ("theta_a", "theta_w", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"{getattr(self, name)} is negative", "use 0 or more")
        if self.prox_scale < 1:
            raise ConfigError("prox_scale", f"{self.prox_scale} < 1", "use 1 or more (1 = step 1/Lipschitz)")


SWEEPS = ("forward", "backward-forward", "local-first")


@dataclass
class ADMMState:
    """Per-sample primal and dual variables (local to a shard in the parallel variants)."""

    a: torch.Tensor  # (T, N, H)
    s: torch.Tensor  # (T, N, H)
    o: torch.Tensor  # (len(out_steps), N, K)
    lam_a: torch.Tensor
    lam_s: torch.Tensor
    lam_o: torch.Tensor


def init_state(params: RNNParams, data: SequenceData) -> ADMMState:
    """Primal variables from a forward pass (all constraints hold), duals zero."""
    a, s, o = forward(params, data.x)
    o = o[list(data.out_steps)].clone()
    return ADMMState(a, s, o, torch.zeros_like(a), torch.zeros_like(s), torch.zeros_like(o))


def _previous_states(state: ADMMState) -> torch.Tensor:
    """s_{t-1} for t = 1..T, with s_0 = 0."""
    return torch.cat([torch.zeros_like(state.s[:1]), state.s[:-1]])


def _design(*blocks: torch.Tensor) -> torch.Tensor:
    """Rows [blocks..., 1] of all steps and samples, flattened to (rows, features + 1)."""
    ones = blocks[0].new_ones(*blocks[0].shape[:-1], 1)
    z = torch.cat([*blocks, ones], dim=-1)
    return z.reshape(-1, z.shape[-1])


def recurrent_stats(data: SequenceData, state: ADMMState, cfg: ADMMConfig) -> torch.Tensor:
    """Sufficient statistics of the U/W/b sub-problem, flattened: [Z^T Z, Z^T Y] with rows
    Z = [x_t, s_{t-1}, 1] and targets Y = a_t + lam_a_t / rho_a."""
    z = _design(data.x, _previous_states(state))
    y = (state.a + state.lam_a / cfg.rho_a).reshape(z.shape[0], -1)
    return torch.cat([(z.T @ z).reshape(-1), (z.T @ y).reshape(-1)])


def output_stats(data: SequenceData, state: ADMMState, cfg: ADMMConfig) -> torch.Tensor:
    """Sufficient statistics of the V/c sub-problem: rows Z = [s_t, 1] on output steps,
    targets o_t + lam_o_t / rho_o."""
    z = _design(state.s[list(data.out_steps)])
    y = (state.o + state.lam_o / cfg.rho_o).reshape(z.shape[0], -1)
    return torch.cat([(z.T @ z).reshape(-1), (z.T @ y).reshape(-1)])


def _split_stats(stats: torch.Tensor, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    gram = stats[: features * features].reshape(features, features)
    return gram, stats[features * features :].reshape(features, -1)


def _linearized_step(theta: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor, cols: slice,
                     rho: float, cfg: ADMMConfig) -> torch.Tensor:
    """One proximal-linear step on the columns ``cols`` of theta for
    rho/2 |Y - Z theta^T|^2 + nu/2 n |theta_cols|^2 (n rows, nu = ``cfg.weight_decay``).

    Gradient rho (theta G - B^T)[:, cols] + nu n theta_cols; the curvature in those columns is
    L = rho |G[cols, cols]|_2 + nu n. The step is 1 / (prox_scale L + theta_w n): theta_w = 0 is
    the largest step that never increases the sub-problem, theta_w > 0 a proximal term
    theta_w n / 2 |theta - theta_k|^2 that bounds the step when G is near zero.
    """
    count = float(gram[-1, -1])  # rows of Z: the last column of Z is the constant 1
    grad = rho * (theta @ gram[:, cols] - cross[cols].T) + cfg.weight_decay * count * theta[:, cols]
    lipschitz = rho * float(torch.linalg.matrix_norm(gram[cols, cols], ord=2)) + cfg.weight_decay * count
    out = theta.clone()
    out[:, cols] = theta[:, cols] - grad / max(cfg.prox_scale * lipschitz + cfg.theta_w * count, 1e-12)
    return out


def _bias_closed_form(theta: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor) -> torch.Tensor:
    """argmin over the bias column (the last): mean over rows of Y - Z[:, :-1] theta[:, :-1]^T."""
    count = gram[-1, -1]
    return (cross[-1] - theta[:, :-1] @ gram[:-1, -1]) / count


def update_recurrent_params(params: RNNParams, stats: torch.Tensor, cfg: ADMMConfig) -> RNNParams:
    """U (linearized), then W (linearized), then b (closed form), from summed statistics."""
    hidden, d = params.W.shape[0], params.U.shape[1]
    gram, cross = _split_stats(stats, d + hidden + 1)
    theta = torch.cat([params.U, params.W, params.b[:, None]], dim=1)
    theta = _linearized_step(theta, gram, cross, slice(0, d), cfg.rho_a, cfg)
    theta = _linearized_step(theta, gram, cross, slice(d, d + hidden), cfg.rho_a, cfg)
    theta[:, -1] = _bias_closed_form(theta, gram, cross)
    return replace(params, U=theta[:, :d].clone(), W=theta[:, d:-1].clone(), b=theta[:, -1].clone())


def update_output_params(params: RNNParams, stats: torch.Tensor, cfg: ADMMConfig) -> RNNParams:
    """V (linearized), then c (closed form)."""
    hidden = params.V.shape[1]
    gram, cross = _split_stats(stats, hidden + 1)
    theta = torch.cat([params.V, params.c[:, None]], dim=1)
    theta = _linearized_step(theta, gram, cross, slice(0, hidden), cfg.rho_o, cfg)
    theta[:, -1] = _bias_closed_form(theta, gram, cross)
    return replace(params, V=theta[:, :-1].clone(), c=theta[:, -1].clone())


def update_a(params: RNNParams, state: ADMMState, data: SequenceData, cfg: ADMMConfig) -> None:
    """Closed form after tanh(a) ~ tanh(a0) + tanh'(a0) (a - a0); elementwise per unit.

    Minimizes rho_a/2 (a - m)^2 + rho_s/2 (tanh(a0) + d (a - a0) - q)^2 + theta_a/2 (a - a0)^2
    with m the a-constraint's target and q the s-constraint's target.
    """
    a0 = state.a
    m = data.x @ params.U.T + _previous_states(state) @ params.W.T + params.b - state.lam_a / cfg.rho_a
    q = state.s + state.lam_s / cfg.rho_s
    t0 = torch.tanh(a0)
    d = 1 - t0 * t0
    numerator = cfg.rho_a * m + cfg.rho_s * d * (q - t0 + d * a0) + cfg.theta_a * a0
    state.a = numerator / (cfg.rho_a + cfg.rho_s * d * d + cfg.theta_a)


def update_s(params: RNNParams, state: ADMMState, data: SequenceData, cfg: ADMMConfig) -> None:
    """Exact minimizer for every s_t: given all a, the s_t are decoupled, each a small linear
    system with matrix rho_s I + rho_o V^T V [t has output] + rho_a W^T W [t < T]."""
    steps, hidden = state.s.shape[0], state.s.shape[2]
    eye = torch.eye(hidden, dtype=state.s.dtype)
    out_index = {t: i for i, t in enumerate(data.out_steps)}
    vtv, wtw = params.V.T @ params.V, params.W.T @ params.W
    new_s = torch.empty_like(state.s)
    for t in range(steps):
        matrix = cfg.rho_s * eye
        rhs = cfg.rho_s * (torch.tanh(state.a[t]) - state.lam_s[t] / cfg.rho_s)
        if t in out_index:
            i = out_index[t]
            matrix = matrix + cfg.rho_o * vtv
            rhs = rhs + cfg.rho_o * (state.o[i] + state.lam_o[i] / cfg.rho_o - params.c) @ params.V
        if t + 1 < steps:
            matrix = matrix + cfg.rho_a * wtw
            target = state.a[t + 1] + state.lam_a[t + 1] / cfg.rho_a - data.x[t + 1] @ params.U.T - params.b
            rhs = rhs + cfg.rho_a * target @ params.W
        new_s[t] = torch.linalg.solve(matrix, rhs.T).T
    state.s = new_s


def update_o(params: RNNParams, state: ADMMState, data: SequenceData, cfg: ADMMConfig) -> None:
    """``o_steps`` gradient steps on CE(o, y) + rho_o/2 |o - h|^2, h = s V^T + c - lam_o/rho_o,
    started from the current o. Step 1/(rho_o + 1/2): the softmax cross-entropy Hessian is
    bounded by 1/2."""
    h = state.s[list(data.out_steps)] @ params.V.T + params.c - state.lam_o / cfg.rho_o
    onehot = torch.nn.functional.one_hot(data.y, data.num_classes).to(h.dtype)
    o = state.o
    step = 1.0 / (cfg.rho_o + 0.5)
    for _ in range(cfg.o_steps):
        o = o - step * (torch.softmax(o, dim=-1) - onehot + cfg.rho_o * (o - h))
    state.o = o


def residuals(params: RNNParams, state: ADMMState, data: SequenceData) -> dict[str, torch.Tensor]:
    """The three constraint residuals r_a, r_s, r_o (same shapes as a, s, o)."""
    r_a = state.a - (data.x @ params.U.T + _previous_states(state) @ params.W.T + params.b)
    r_s = state.s - torch.tanh(state.a)
    r_o = state.o - (state.s[list(data.out_steps)] @ params.V.T + params.c)
    return {"a": r_a, "s": r_s, "o": r_o}


def update_duals(params: RNNParams, state: ADMMState, data: SequenceData, cfg: ADMMConfig) -> None:
    res = residuals(params, state, data)
    state.lam_a = state.lam_a + cfg.rho_a * res["a"]
    state.lam_s = state.lam_s + cfg.rho_s * res["s"]
    state.lam_o = state.lam_o + cfg.rho_o * res["o"]


def local_sums(params: RNNParams, state: ADMMState, data: SequenceData, cfg: ADMMConfig) -> torch.Tensor:
    """[augmented Lagrangian, |r_a|^2, |r_s|^2, |r_o|^2, samples] summed over this shard's samples,
    so that a parallel run can all-reduce them into the global values."""
    res = residuals(params, state, data)
    lagrangian = cross_entropy_sum(state.o, data.y)
    duals = (("a", state.lam_a, cfg.rho_a), ("s", state.lam_s, cfg.rho_s), ("o", state.lam_o, cfg.rho_o))
    for key, lam, rho in duals:
        lagrangian = lagrangian + (lam * res[key]).sum() + rho / 2 * (res[key] ** 2).sum()
    squares = [(res[k] ** 2).sum() for k in ("a", "s", "o")]
    return torch.stack([lagrangian, *squares, torch.tensor(float(data.samples), dtype=lagrangian.dtype)])


def reanchor(params: RNNParams, state: ADMMState, data: SequenceData) -> None:
    """a, s, o := the forward pass of ``params`` (all three constraints then hold); duals kept."""
    a, s, o = forward(params, data.x)
    state.a, state.s, state.o = a, s, o[list(data.out_steps)].clone()


def update_local(params: RNNParams, state: ADMMState, data: SequenceData, cfg: ADMMConfig) -> None:
    """The per-sample blocks a, s, o and the duals with the weights fixed (AP's worker step),
    after re-anchoring if ``cfg.reanchor``."""
    if cfg.reanchor:
        reanchor(params, state, data)
    update_a(params, state, data, cfg)
    update_s(params, state, data, cfg)
    update_o(params, state, data, cfg)
    update_duals(params, state, data, cfg)


def admm_iteration(params: RNNParams, state: ADMMState, data: SequenceData, cfg: ADMMConfig,
                   reduce: Reduce = no_reduce) -> RNNParams:
    """One ADMMiRNN iteration in the block order ``cfg.sweep``; updates ``state`` in place and
    returns the new weights. ``reduce`` sums the parameter statistics over data shards."""
    if cfg.sweep == "local-first":
        update_local(params, state, data, cfg)
        recurrent, output = reduce(recurrent_stats(data, state, cfg)), reduce(output_stats(data, state, cfg))
        return update_output_params(update_recurrent_params(params, recurrent, cfg), output, cfg)
    if cfg.reanchor:
        reanchor(params, state, data)
    if cfg.sweep == "backward-forward":
        update_o(params, state, data, cfg)
        params = update_output_params(params, reduce(output_stats(data, state, cfg)), cfg)
        update_s(params, state, data, cfg)
        update_a(params, state, data, cfg)
    params = update_recurrent_params(params, reduce(recurrent_stats(data, state, cfg)), cfg)
    update_a(params, state, data, cfg)
    update_s(params, state, data, cfg)
    params = update_output_params(params, reduce(output_stats(data, state, cfg)), cfg)
    update_o(params, state, data, cfg)
    update_duals(params, state, data, cfg)
    return params


def summarize(sums: torch.Tensor) -> dict[str, float]:
    """Per-sample augmented Lagrangian and RMS-per-sample residual norms from :func:`local_sums`."""
    samples = float(sums[4])
    return {
        "lagrangian": float(sums[0]) / samples,
        "residual_a": (float(sums[1]) / samples) ** 0.5,
        "residual_s": (float(sums[2]) / samples) ** 0.5,
        "residual_o": (float(sums[3]) / samples) ** 0.5,
    }


def train_admm(
    train: SequenceData,
    hidden: int,
    iterations: int,
    cfg: ADMMConfig = ADMMConfig(),
    seed: int = 0,
    validation: SequenceData | None = None,
    init_scale: float = 1.0,
) -> tuple[RNNParams, list[dict[str, float]]]:
    """Serial ADMMiRNN on the whole training set. History row per iteration (0 = the start), with
    ``val_loss`` / ``val_acc`` on ``validation`` where given (the test split is evaluated once, by
    the caller, on the returned weights)."""
    import time

    params = init_params(train.input_dim, hidden, train.num_classes, seed, train.x.dtype, init_scale)
    state = init_state(params, train)
    history = []
    elapsed = 0.0
    for it in range(iterations + 1):
        if it > 0:
            start = time.perf_counter()
            params = admm_iteration(params, state, train, cfg)
            elapsed += time.perf_counter() - start
        row = {"iteration": it, "time_s": elapsed, **summarize(local_sums(params, state, train, cfg))}
        row["train_loss"], row["train_acc"] = evaluate(params, train)
        if validation is not None:
            row["val_loss"], row["val_acc"] = evaluate(params, validation)
        history.append(row)
    return params, history
