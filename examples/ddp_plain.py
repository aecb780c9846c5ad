"""A plain PyTorch DDP training script, the starting point of ddp_to_distrain.py.

    torchrun --nproc-per-node 4 examples/ddp_plain.py
"""

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()
    return TensorDataset(x, y)


def main() -> None:
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 3))
    model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank = torch.distributed.get_rank()
    data = make_data()
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data))
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f}")
    final = model.module
    with torch.no_grad():
        accuracy = (final(data.tensors[0]).argmax(1) == data.tensors[1]).float().mean().item()
    if rank == 0:
        print(f"training accuracy {accuracy:.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
