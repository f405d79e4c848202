# One image for every node of a job, so each runs the same PyTorch, CUDA, NCCL and kiln.
#   docker build -t kiln:latest .
#   docker run --gpus all --ipc=host -v $PWD/runs:/runs kiln:latest \
#       kiln launch --nproc-per-node gpu -- train --set run.dir=/runs/demo
# The base image pins PyTorch with its matching CUDA runtime, cuDNN and NCCL; kiln's own
# requirement is a range (torch>=2.6), so pip keeps the image's torch instead of replacing it.
ARG PYTORCH_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${PYTORCH_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KILN_CACHE=/cache \
    # Fail a hung collective with an error (and a restart under --max-restarts) instead of waiting forever.
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 \
    # A fresh rendezvous store per restart (see docs/distributed.md, fault tolerance).
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

WORKDIR /opt/kiln
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir . && python -c "import kiln, torch; print('kiln ready, torch', torch.__version__)"

VOLUME ["/cache", "/runs"]
WORKDIR /runs
CMD ["kiln", "--help"]
