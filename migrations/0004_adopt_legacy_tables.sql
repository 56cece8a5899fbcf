-- Upgrade from the releases that kept the product's tables in `public` (migrations 1 to 3 recorded
-- (and 4) in public._sqlx_migrations): their rows move into this schema, then those tables go.
--
-- Only tables provably ours are touched: public._sqlx_migrations must hold version 1 with the
-- checksum of that release's migration file. Pending, published and dead outbox rows keep their
-- order (new seq in old seq order), state, attempts and last error; a pending row that breaks a
-- publishability rule becomes dead with the reason (it could never have been published). Every
-- processed_messages row and idempotency record is kept. The demo's tables (orders, payments, ...)
-- are left to the demo's own migrations. Stop the old relays before running this.
--
-- So that producers and consumers of the previous release keep working while their teams upgrade
-- them (no lockstep deploy), public.outbox and public.processed_messages are left behind as
-- simple views of the new tables: an old `INSERT INTO outbox (...)` lands in {{schema}}.messages
-- (its defaults, its CHECK constraints, its NOTIFY), and an old consumer's dedup statements use
-- the same {{schema}}.processed_messages as the new ones. The views get the old tables' grants
-- (SELECT, INSERT, UPDATE, DELETE), so least-privilege roles keep theirs. Drop the views once
-- nothing uses them.
--
-- On a database without those tables this does nothing.

-- Gives a compatibility view the SELECT, INSERT, UPDATE and DELETE grants the table it replaces
-- had (other privileges mean nothing on a simple view); used below, then dropped.
CREATE FUNCTION {{schema}}.legacy_grant(target regclass, acl aclitem[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT a.privilege_type,
               CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee
          FROM aclexplode(coalesce(acl, '{}'::aclitem[])) AS a
          LEFT JOIN pg_roles r ON r.oid = a.grantee
         WHERE a.privilege_type IN ('SELECT', 'INSERT', 'UPDATE', 'DELETE')
           AND (a.grantee = 0 OR r.oid IS NOT NULL)
    LOOP
        EXECUTE format('GRANT %s ON %s TO %s', g.privilege_type, target, g.grantee);
    END LOOP;
END
$$;

DO $$
DECLARE
    legacy boolean;
    ours_processed boolean;
    ours_keys boolean;
    outbox_acl aclitem[];
    processed_acl aclitem[];
BEGIN
    legacy := to_regclass('public._sqlx_migrations') IS NOT NULL
          AND to_regclass('public.outbox') IS NOT NULL;
    IF legacy THEN
        legacy := EXISTS (
            SELECT 1 FROM public._sqlx_migrations
             WHERE version = 1 AND description = 'outbox' AND success
               AND checksum = '\xeac2b9d039ed69a9febd0a87f9d9852baa989b55c8a25be70ce77f54cf67800cee10a0c89c22023b5fd5b66294808ca3'::bytea
        );
    END IF;
    IF NOT legacy THEN
        RETURN;
    END IF;
    RAISE NOTICE 'moving the outbox tables of the previous release from public into {{schema}}';
    ours_processed := to_regclass('public.processed_messages') IS NOT NULL
        AND EXISTS (SELECT 1 FROM public._sqlx_migrations WHERE version = 2 AND description = 'consumer'
                    AND checksum = '\xc72da5b5373351a44de8ba18e84b7b913d947c25f81c93a0fec46d257eb27be4abdb12834fc629009dfa900b3947d875'::bytea);
    ours_keys := to_regclass('public.idempotency_keys') IS NOT NULL
        AND EXISTS (SELECT 1 FROM public._sqlx_migrations WHERE version = 3 AND description = 'producer'
                    AND checksum = '\x18479959f4dd5009f08f912f6afb7c1d045014806b8713809050aa09bfa93ff352ac1709c83f45352ec3194c68521eed'::bytea);

    -- Nothing may write to them while they move: all at once, in one statement (no row a running
    -- producer or consumer commits between the copy and the drop; no lock-order deadlock with it).
    EXECUTE 'LOCK TABLE public.outbox'
        || CASE WHEN ours_processed THEN ', public.processed_messages' ELSE '' END
        || CASE WHEN ours_keys THEN ', public.idempotency_keys' ELSE '' END
        || ' IN ACCESS EXCLUSIVE MODE';
    outbox_acl := (SELECT relacl FROM pg_class WHERE oid = 'public.outbox'::regclass);

    INSERT INTO {{schema}}.messages
        (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at,
         state, attempts, last_error, last_attempt_at, published_at)
    SELECT o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload, o.headers, o.created_at,
           CASE WHEN o.state = 'pending' AND r.reason IS NOT NULL THEN 'dead' ELSE o.state END,
           CASE WHEN o.state = 'pending' AND r.reason IS NOT NULL THEN o.attempts + 1 ELSE o.attempts END,
           CASE WHEN o.state = 'pending' AND r.reason IS NOT NULL THEN 'unpublishable: ' || r.reason ELSE o.last_error END,
           o.last_attempt_at, o.published_at
      FROM public.outbox o
      CROSS JOIN LATERAL (SELECT {{schema}}.unpublishable_reason(
          o.event_type, o.aggregate_type, o.aggregate_id, o.created_at, o.headers) AS reason) r
     ORDER BY o.seq;

    IF ours_processed THEN
        processed_acl := (SELECT relacl FROM pg_class WHERE oid = 'public.processed_messages'::regclass);
        INSERT INTO {{schema}}.processed_messages (consumer, message_id, processed_at)
        SELECT consumer, message_id, processed_at FROM public.processed_messages
        ON CONFLICT DO NOTHING;
        DROP TABLE public.processed_messages;
        CREATE VIEW public.processed_messages AS
            SELECT consumer, message_id, processed_at FROM {{schema}}.processed_messages;
        COMMENT ON VIEW public.processed_messages IS 'Left by the upgrade to schema {{schema}}, for consumers of the previous release: their INSERT ... ON CONFLICT and DELETE statements act on {{schema}}.processed_messages. Drop it once every consumer runs the new release.';
        PERFORM {{schema}}.legacy_grant('public.processed_messages', processed_acl);
    END IF;

    IF ours_keys THEN
        INSERT INTO {{schema}}.idempotency_keys
            (scope, operation, key_hash, fingerprint, status, response_status, response_body,
             resource_id, lease_token, lease_expires_at, created_at, updated_at, expires_at)
        SELECT tenant, operation, key_hash, fingerprint, status, response_status, response_body,
               resource_id, lease_token, lease_expires_at, created_at, updated_at, expires_at
          FROM public.idempotency_keys
        ON CONFLICT DO NOTHING;
        -- The old demo trigger on payments resolved records in public.idempotency_keys.
        DROP TRIGGER IF EXISTS payments_resolve_idempotency ON public.payments;
        DROP FUNCTION IF EXISTS public.payments_resolve_idempotency();
        DROP TABLE public.idempotency_keys;
    END IF;

    DROP TABLE public.outbox;
    DROP FUNCTION IF EXISTS public.outbox_notify();
    CREATE VIEW public.outbox AS
        SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, created_at
          FROM {{schema}}.messages;
    COMMENT ON VIEW public.outbox IS 'Left by the upgrade to schema {{schema}}, for producers of the previous release: INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload[, id, headers]) lands in {{schema}}.messages with its defaults, constraints and NOTIFY. Drop it once every producer writes {{schema}}.messages.';
    PERFORM {{schema}}.legacy_grant('public.outbox', outbox_acl);
    -- Release migration 4 (outbox publishable): the functions behind its CHECK constraints.
    IF EXISTS (SELECT 1 FROM public._sqlx_migrations WHERE version = 4 AND description = 'outbox publishable'
               AND checksum = '\x84e9f3aa556d89b0db055ac203b3b0f9a448c358be446245a918d5b74826f2f4cf8f6648859f2a3e7145a593cbe56022'::bytea) THEN
        DROP FUNCTION IF EXISTS public.outbox_unpublishable_reason(text, text, text, timestamptz, jsonb);
        DROP FUNCTION IF EXISTS public.outbox_headers_flat_scalars(jsonb);
        DROP FUNCTION IF EXISTS public.outbox_header_names_fit(jsonb);
        DROP FUNCTION IF EXISTS public.outbox_header_names_not_reserved(jsonb);
        DROP FUNCTION IF EXISTS public.outbox_headers_fit(jsonb);
        DELETE FROM public._sqlx_migrations WHERE version = 4 AND description = 'outbox publishable';
    END IF;
    DROP TABLE IF EXISTS public.relay_partitions;
    DROP TABLE IF EXISTS public.relay_instances;

    -- The service's own migration history must not list ours (sqlx would refuse to run its
    -- migrations: "previously applied but missing").
    DELETE FROM public._sqlx_migrations
     WHERE (version, description) IN ((1, 'outbox'), (2, 'consumer'), (3, 'producer'));
    IF NOT EXISTS (SELECT 1 FROM public._sqlx_migrations) THEN
        DROP TABLE public._sqlx_migrations;
    END IF;
END
$$;

DROP FUNCTION {{schema}}.legacy_grant(regclass, aclitem[]);
