"""ddp_plain.py with distrain: the same model, data and loop, any algorithm, any network.

    distrain launch --workers 4 examples/ddp_to_distrain.py                  # this machine
    distrain launch --workers 4 --network edge examples/ddp_to_distrain.py   # an emulated edge network
    torchrun --nproc-per-node 4 examples/ddp_to_distrain.py                  # or under torchrun
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

import distrain


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()
    return TensorDataset(x, y)


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 3))
    # any of allreduce, dpsgd, d2, adpsgd, prague, diloco; compress="group_topk:0.01" for allreduce
    opt = distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), algorithm="dpsgd")
    rank = opt.rank
    data = make_data()
    loader = DataLoader(opt.shard(data), batch_size=64, shuffle=True)
    for epoch in range(3):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f}")
    final = opt.finish()  # the consensus of the workers' models
    with torch.no_grad():
        accuracy = (final(data.tensors[0]).argmax(1) == data.tensors[1]).float().mean().item()
    if rank == 0:
        print(f"training accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
