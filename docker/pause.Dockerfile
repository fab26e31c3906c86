# The test node's pod sandbox image (containerd's sandbox_image, the kubelet's
# --pod-infra-container-image): one static binary, nothing else. scripts/images.sh compiles
# docker/pause/main.go and builds this with the binary's folder as the context.
FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]
