-- oncely 0004: the trace context staged with an outbox row or a task.
-- Runs inside one transaction with search_path set to the target schema.
--
-- The W3C trace context (traceparent, tracestate, baggage) active when the row was written, as
-- Java properties text: Debezium's Outbox Event Router reads this column by its default name
-- (tracing.span.context.field), oncely's relay and task worker parent their spans on it. NULL
-- when no span was active. Adding a nullable column rewrites nothing.
ALTER TABLE oncely_outbox ADD COLUMN tracingspancontext text;
ALTER TABLE oncely_tasks ADD COLUMN tracingspancontext text;
