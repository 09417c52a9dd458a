# async_cosyvoice on a CUDA machine with vLLM as the speech-token engine.
#
# Built on the vLLM project's own image, so torch, CUDA and vLLM are the ones vLLM ships and
# tests together; our package declares torch>=2.5 only and installs on top without replacing it
# (scripts/check_install_over_torch.sh shows that for a CUDA torch). NOT built or run by this
# project's CI: our machines have no Docker daemon and no GPU.
#
#   docker build -t async-cosyvoice .
#   docker run --gpus all -p 50051:50051 -p 8000:8000 \
#       -v /path/to/CosyVoice2-0.5B:/models/CosyVoice2-0.5B -v cosyvoice-speakers:/data/speakers \
#       async-cosyvoice
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

WORKDIR /opt/async_cosyvoice
COPY . .

# The project with its HTTP front door and ONNX Runtime for CUDA. The CPU onnxruntime (a core
# dependency) and onnxruntime-gpu install the same module: drop the CPU one, reinstall the GPU
# one's files. Then fail the build if torch or vLLM changed or CUDA is missing from ORT.
RUN python3 -c "import torch, vllm; print(torch.__version__, vllm.__version__)" > /tmp/before \
 && python3 -m pip install --no-cache-dir ".[http,gpu]" \
 && python3 -m pip uninstall -y onnxruntime \
 && python3 -m pip install --no-cache-dir --force-reinstall --no-deps "onnxruntime-gpu>=1.20" \
 && python3 -c "import torch, vllm; print(torch.__version__, vllm.__version__)" > /tmp/after \
 && diff /tmp/before /tmp/after \
 && python3 -c "import onnxruntime as ort; assert 'CUDAExecutionProvider' in ort.get_available_providers()" \
 && python3 -m grpc_async._stubs

ENV ASYNC_COSYVOICE__MODEL__DIR=/models/CosyVoice2-0.5B \
    ASYNC_COSYVOICE__MODEL__DEVICE=cuda \
    ASYNC_COSYVOICE__ENGINE__KIND=vllm \
    ASYNC_COSYVOICE__SPEAKERS__DIR=/data/speakers \
    ASYNC_COSYVOICE__SERVER__HOST=0.0.0.0

EXPOSE 50051 8000
# The vLLM image's entrypoint is `vllm serve`; ours is the CosyVoice server (gRPC on 50051; add
# --http-port 8000 or server.http_port for the HTTP front door).
ENTRYPOINT ["async-cosyvoice", "serve", "--config", "configs/vllm.yaml"]
