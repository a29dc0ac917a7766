# Minimal Murmur peer image (CPU). Build: docker build -t murmur .
# Run:   docker run -p 4001:4001 -v murmur-data:/data murmur \
#          --listen /ip4/0.0.0.0/tcp/4001 --bootstrap /ip4/<host>/tcp/<port>/p2p/<id>
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY node ./node
COPY protocol ./protocol
COPY scripts ./scripts
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir .
RUN useradd --create-home murmur && mkdir /data && chown murmur /data
USER murmur
VOLUME /data
EXPOSE 4001
ENTRYPOINT ["murmur", "run", "--data-dir", "/data"]
CMD ["--listen", "/ip4/0.0.0.0/tcp/4001"]
