"""``torchring.wrap``: parameters and buffers come from rank 0 at wrap; the wrapper passes
attributes, methods and state_dict keys through to the model; checkpoints round-trip between
wrapped and plain models; ``broadcast_buffers`` on and off. References: see _parity.py.
"""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F

from _checks import Checker, assert_no_failures
from _dist import spawn
from _parity import CNN, LR, MLP, PER_RANK, buffers, checked, regression, shard


def _state_job(rank: int) -> list[str]:
    import torchring

    def body(chk: Checker, rank: int, world: int) -> None:
        # parameters and buffers come from rank 0 at wrap, whatever each rank initialized
        torch.manual_seed(100 + rank)
        mine = CNN()
        torch.manual_seed(100)
        want = CNN()
        for m, r in ((mine, rank), (want, 0)):
            with torch.no_grad():
                m.bn.running_mean.fill_(r + 1.0)
                m.bn.running_var.fill_(r + 2.0)
                m.bn.num_batches_tracked.fill_(r)
        if rank:
            chk.true("ranks initialize differently before wrap",
                     not torch.equal(mine.conv1.weight, want.conv1.weight), "same weights")
        ddp = torchring.wrap(mine)
        for k, v in want.state_dict().items():
            chk.equal(f"after wrap, {k} is rank 0's", ddp.state_dict()[k], v)

        # the wrapper: .module, attributes and methods of the inner model, state_dict keys
        torch.manual_seed(3)
        inner = MLP(bn=True)
        ddp = torchring.wrap(inner)
        probe = regression(99, 4)[0]
        chk.true(".module", ddp.module is inner, f"{type(ddp.module)}")
        chk.true(".hidden_size through the wrapper", getattr(ddp, "hidden_size", None) == 16, "")
        with torch.no_grad():
            chk.equal(".features() through the wrapper", ddp.features(probe), inner.features(probe))
        keys = list(MLP(bn=True).state_dict())
        chk.true("state_dict keys", list(ddp.state_dict()) == keys, f"{list(ddp.state_dict())} vs {keys}")
        for k, v in inner.state_dict().items():
            chk.equal(f"state_dict()[{k}]", ddp.state_dict()[k], v)

        # checkpoint: wrapped -> plain -> wrapped, and a resumed run repeats the original exactly
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)

        def train(first: int, steps: int) -> None:
            for step in range(first, first + steps):
                x, y = regression(step, PER_RANK * world)
                opt.zero_grad()
                F.mse_loss(ddp(shard(x, rank)), shard(y, rank)).backward()
                opt.step()

        train(0, 2)
        buf = io.BytesIO()
        torch.save(ddp.state_dict(), buf)
        plain = MLP(bn=True)
        buf.seek(0)
        plain.load_state_dict(torch.load(buf))
        ddp.eval()
        plain.eval()
        with torch.no_grad():
            chk.equal("plain model loaded from the wrapped checkpoint", plain(probe), ddp(probe))
        ddp.train()
        train(2, 2)
        after = {k: v.clone() for k, v in ddp.state_dict().items()}
        buf.seek(0)
        ddp.load_state_dict(torch.load(buf))
        ddp.eval()
        with torch.no_grad():
            chk.equal("wrapped model reloaded from the checkpoint", ddp(probe), plain(probe))
        ddp.train()
        train(2, 2)
        for k, v in ddp.state_dict().items():
            chk.equal(f"resumed run, {k}", v, after[k])

        # buffers: with broadcast_buffers every training forward starts from rank 0's buffers
        for bb in (True, False):
            torch.manual_seed(4)
            inner = MLP(bn=True)
            ddp = torchring.wrap(inner, broadcast_buffers=bb)
            pre: list[dict[str, torch.Tensor]] = []
            post: list[dict[str, torch.Tensor]] = []
            hook = inner.register_forward_pre_hook(lambda mod, args: pre.append(buffers(mod)))
            for step in range(3):
                x, y = regression(step, PER_RANK * world)
                out = ddp(shard(x, rank))
                post.append(buffers(inner))
                F.mse_loss(out, shard(y, rank)).backward()
            hook.remove()
            everyone = torchring.allgather_object((pre, post))
            for step in range(3):
                for name, got in pre[step].items():
                    if bb:
                        src = "rank 0's buffers before the forward"
                        want_b = everyone[0][0][0][name] if step == 0 else everyone[0][1][step - 1][name]
                    else:
                        src = "this rank's own buffers"
                        want_b = pre[0][name] if step == 0 else post[step - 1][name]
                    chk.equal(f"broadcast_buffers={bb} step {step}: {name} at forward is {src}", got,
                              want_b)
            if not bb and world > 1:
                last = [post_r[2]["bn.running_mean"] for _, post_r in everyone[:2]]
                chk.true("broadcast_buffers=False: running stats stay per rank",
                         not torch.equal(last[0], last[1]), "ranks ended with identical statistics")
    return checked(rank, body)


def test_state_dict_attributes_and_buffers() -> None:
    assert_no_failures(spawn(2, _state_job))
