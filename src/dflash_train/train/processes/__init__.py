"""The processes of a run: `train --nproc N` starting and supervising its local ranks, `--detach`, `stop`
(`launch`), and each rank's place in torch.distributed: device, process group, the stop vote (`dist`)."""
