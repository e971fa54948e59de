-- oncely 0009: the rows of parked keys that retention kept aside when it dropped their partition.
-- Runs inside one transaction with search_path set to the target schema.
--
-- A parked key's own row (dead, delayed or blocked) and the rows held behind it are passed by
-- the relay's progress but not published yet. When retention drops an outbox partition, it
-- first copies those rows here, in the same transaction, so that they no longer keep the
-- partition (and every later one) for as long as a delay lasts or a dead row waits. The relay
-- reads a released key's rows from the outbox or from here, and deletes each copy once its
-- key is released. The copy's idempotency key stays in oncely_outbox_keys until then: the
-- trigger below removes it with the copy. Columns: the outbox's (seq, txid and shard as
-- plain values), and when the row was kept.
CREATE TABLE oncely_relay_kept (
    id                 uuid NOT NULL,
    seq                bigint NOT NULL,
    aggregatetype      text NOT NULL,
    aggregateid        text NOT NULL,
    type               text NOT NULL,
    topic              text NOT NULL,
    payload            bytea NOT NULL,
    headers            jsonb NOT NULL,
    event_key          text NOT NULL,
    available_at       timestamptz NOT NULL,
    created_at         timestamptz NOT NULL,
    txid               xid8 NOT NULL,
    shard              smallint NOT NULL,
    tracingspancontext text,
    kept_at            timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT oncely_relay_kept_pkey PRIMARY KEY (id)
);
-- A released key's copies (many, when a missing topic parked every key of it).
CREATE INDEX oncely_relay_kept_key_idx ON oncely_relay_kept (topic, aggregateid);

-- A deleted copy's idempotency key is free again (oncely_outbox_keys exists once the outbox is
-- partitioned; only then are rows kept). SECURITY DEFINER: the relay needs no grant on the keys.
DO $do$ BEGIN EXECUTE
    'CREATE FUNCTION oncely_relay_kept_forget() RETURNS trigger LANGUAGE plpgsql '
    || 'SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$ BEGIN '
    || 'IF to_regclass(' || quote_literal(quote_ident(current_schema()) || '.oncely_outbox_keys')
    || ') IS NOT NULL THEN DELETE FROM ' || quote_ident(current_schema())
    || '.oncely_outbox_keys AS k USING gone AS g '
    || 'WHERE k.event_key = g.event_key AND k.event_id = g.id; END IF; RETURN NULL; END $body$';
END $do$;
CREATE TRIGGER oncely_relay_kept_forget AFTER DELETE ON oncely_relay_kept
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT
    EXECUTE FUNCTION oncely_relay_kept_forget();
