#!/usr/bin/env bash
# The rows of a machine with a core or more per rank, in one command of under 8 minutes on 16 cores:
# the collectives at N = 4 and 8 (4 and 64 MB), and end to end comm_bound at N = 4 and 8 (ddp and every
# strategy) and ResNet-18 at N = 8 (ddp and the ring). Needs torch, Lightning and torchmetrics, not Hydra.
#
#   bash benchmarks/many_core.sh [OUT]     # OUT: where the results go (default benchmarks/results)
#
# Writes OUT/collectives_many_core.{json,md,png}, OUT/end_to_end_many_core.{json,md} and
# OUT/end_to_end_many_core_resnet18.{json,md}; each records its command and the machine.
set -euo pipefail
out=${1:-benchmarks/results}
mkdir -p "$out"
python -m benchmarks.collectives --world-sizes 4 8 --sizes-mb 4 64 --repeats 5 --name collectives_many_core --out "$out"
python -m benchmarks.end_to_end --models comm_bound --world-sizes 4 8 --steps 15 --name end_to_end_many_core \
  --strategies ddp ring_allreduce ring_allreduce@ring parameter_server sharded_ps --out "$out"
python -m benchmarks.end_to_end --models resnet18 --world-sizes 8 --steps 10 --name end_to_end_many_core_resnet18 \
  --strategies ddp ring_allreduce --out "$out"
