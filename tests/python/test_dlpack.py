"""DLPack: torch.from_dlpack(view) over a page, without a copy, bf16 as
torch.bfloat16; the tensor counts as an export of the view until it dies."""
import gc

import numpy as np
import pytest

import kvpager

torch = pytest.importorskip("torch")  # python3-torch: optional (docs/python.md)


def test_bf16_page_as_torch_bfloat16():
    with kvpager.Pool(block_tokens=4, heads=2, head_width=4, budget_bytes=1 << 12,
                      dtype="bf16") as p:
        c = kvpager.Cache(p, batch_size=1, capacity=8)
        k = np.arange(24.0).reshape(1, 2, 3, 4) / 4
        c.append_rows(k, -k)
        view = c.page_view(0, 0)
        t = torch.from_dlpack(view)
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == (2, 2, 3, 4)
        assert t.data_ptr() == np.asarray(view).__array_interface__["data"][0]
        assert torch.equal(t[0].to(torch.float64), torch.from_numpy(k[0]))
        assert torch.equal(t[1].to(torch.float64), torch.from_numpy(-k[0]))
        assert view.exports == 1
        with pytest.raises(BufferError):
            c.truncate(1)
        del t
        gc.collect()
        assert view.exports == 0
        c.truncate(1)
        with pytest.raises(kvpager.PageNotHeld):
            torch.from_dlpack(view)
        c.close()


@pytest.mark.parametrize("dtype,torch_dtype", [("f64", "float64"), ("f32", "float32"),
                                               ("f16", "float16"), ("fp8_e4m3", "uint8")])
def test_other_dtypes(dtype, torch_dtype):
    with kvpager.Pool(block_tokens=4, heads=1, head_width=4, budget_bytes=1 << 12,
                      dtype=dtype) as p:
        c = kvpager.Cache(p, batch_size=1, capacity=8)
        k = np.ones((1, 1, 2, 4))
        c.append_rows(k, k)
        t = torch.from_dlpack(c.page_view(0, 0))
        assert t.dtype == getattr(torch, torch_dtype) and tuple(t.shape) == (2, 1, 2, 4)
        assert t.__dlpack_device__()[0] == 1
        del t
        c.close()


def test_unconsumed_capsule_releases_its_export():
    with kvpager.Pool(block_tokens=4, heads=1, head_width=4, budget_bytes=1 << 12) as p:
        c = kvpager.Cache(p, batch_size=1, capacity=8)
        c.append_rows(np.ones((1, 1, 2, 4)), np.ones((1, 1, 2, 4)))
        view = c.page_view(0, 0)
        cap = view.__dlpack__()
        assert view.exports == 1
        del cap
        assert view.exports == 0
        assert view.__dlpack_device__() == (1, 0)
        c.close()
