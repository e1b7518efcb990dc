#!/bin/bash
# Every host of a TPU VM pod slice runs the same command (--worker=all); --cluster=auto lets JAX find the
# coordinator, process count and rank from the TPU metadata server. The repository is checked out in
# ~/spmdlab on every host. Usage: TPU=my-v5e-32 ZONE=us-west4-a bash experiments/launch/tpu_vm.sh
gcloud compute tpus tpu-vm ssh "${TPU:-my-tpu}" --zone="${ZONE:-us-central2-b}" --worker=all --command="cd ~/spmdlab && \
python -m experiments.train --cluster=auto --workdir=gs://my-bucket/runs/llama-1b \
--config.model.preset=llama-1b --config.model.dtype=bfloat16 --config.mesh=fsdp:-1"
