"""Hooks and models shared by the tests."""

import torch
import torch.fx

from torch_patches._functorch._aot_autograd.graph_compile import HOOK_META


def bf16_pack(x):
    return x.to(torch.bfloat16)


def bf16_unpack(x):
    return x.to(torch.float32)


def dtype_pack(x):
    # Tuple output: the original dtype rides along as a constant.
    return (x.dtype, x.to(torch.bfloat16))


def dtype_unpack(packed):
    dtype, t = packed
    return t.to(dtype)


def flat_pack(x):
    # Shape-changing pack: keep a flat copy and the sizes to restore it.
    return (x.shape, x.reshape(-1) * 2)


def flat_unpack(packed):
    shape, flat = packed
    return (flat / 2).reshape(shape)


def exact_pack(x):
    # Lossless: multiplying by 2 and dividing by 2 is exact in floating point.
    return x * 2


def exact_unpack(x):
    return x / 2


def graph_hooks(pack, unpack):
    return torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(unpack)


BF16 = graph_hooks(bf16_pack, bf16_unpack)
DTYPE = graph_hooks(dtype_pack, dtype_unpack)
FLAT = graph_hooks(flat_pack, flat_unpack)
EXACT = graph_hooks(exact_pack, exact_unpack)


def hook_chains(gm, role):
    """saved name -> list of consecutive hook nodes of ``role`` (pack/unpack)."""
    chains = {}
    for node in gm.graph.nodes:
        info = node.meta.get(HOOK_META)
        if info and info["role"] == role:
            chains.setdefault(info["saved"], []).append(node)
    return chains


def check_placed_at_use(test, fw, bw):
    """Each pack directly follows its tensor's last forward use, each unpack directly
    precedes the first backward use of what it restores (other hooks may sit between)."""
    fw_nodes = list(fw.graph.nodes)
    for saved_name, chain in hook_chains(fw, "pack").items():
        saved = next(n for n in fw_nodes if n.name == saved_name)
        users = [u for u in saved.users if u.op != "output" and HOOK_META not in u.meta]
        node = chain[0].prev
        while HOOK_META in node.meta:
            node = node.prev
        if users:
            test.assertIs(node, max(users, key=fw_nodes.index), f"pack of {saved_name}")
        else:
            test.assertTrue(node is saved or node.op == "placeholder", f"pack of {saved_name}")
    for saved_name, chain in hook_chains(bw, "unpack").items():
        result = chain[-1]
        node = result.next
        while HOOK_META in node.meta:
            node = node.next
        test.assertIn(node, result.users, f"unpack of {saved_name} is not right before its first use")


class RowScaled(torch.Tensor):
    """A packed form as one tensor: bf16 rows and their float32 scales (a wrapper subclass).

    Looks like the float32 tensor it encodes; any op on it runs on the decoded values.
    """

    @staticmethod
    def __new__(cls, data, scale):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=scale.dtype, device=data.device)

    def __init__(self, data, scale):
        self.data_ = data
        self.scale = scale

    def __tensor_flatten__(self):
        return ["data_", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return RowScaled(inner["data_"], inner["scale"])

    def decode(self):
        return self.data_.to(self.scale.dtype) * self.scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(t):
            return t.decode() if isinstance(t, RowScaled) else t

        return func(*torch.utils._pytree.tree_map(plain, args), **torch.utils._pytree.tree_map(plain, kwargs or {}))

    def __repr__(self):
        return f"RowScaled({self.decode()!r})"


def row_scaled_pack(x):
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    return RowScaled((x / scale).to(torch.bfloat16), scale)


def row_scaled_unpack(packed):
    return packed.decode()


def exact_scaled_pack(x):
    # Lossless RowScaled: twice the values, scales of one half.
    return RowScaled(x * 2, torch.full_like(x[..., :1], 0.5))
