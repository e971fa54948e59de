# One image for every oncely process; the entrypoint is the `oncely` CLI:
#   docker run --rm oncely:dev relay run
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim
RUN useradd --system --uid 10001 oncely
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER oncely
ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["oncely"]
CMD ["--help"]
