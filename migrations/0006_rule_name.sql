-- A display name per rule: logs and metric labels show a tenant by the
-- name its rules give (or by a fingerprint of its key), never by the key,
-- which is a secret. Same rules as the gateway's: 1-64 bytes of letters,
-- digits, spaces and . _ : -, starting with a letter or digit. Change
-- events carry the name.

ALTER TABLE rate_limit_rule
    ADD COLUMN name varchar(64)
        CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9 ._:-]{0,63}$');

CREATE OR REPLACE FUNCTION tollgate_rule_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE'
       OR (TG_OP = 'UPDATE' AND (OLD.tenant_id, OLD.route_id) IS DISTINCT FROM (NEW.tenant_id, NEW.route_id)) THEN
        PERFORM pg_notify('tollgate_rules', json_build_object(
            'op', 'delete', 'tenant', OLD.tenant_id, 'route', OLD.route_id,
            'seq', nextval('tollgate_rule_change_seq'))::text);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('tollgate_rules', json_build_object(
            'op', 'upsert', 'tenant', NEW.tenant_id, 'route', NEW.route_id,
            'capacity', NEW.capacity, 'refill_per_second', NEW.refill_per_second,
            'shards', NEW.shards, 'exact', NEW.exact, 'name', NEW.name,
            'seq', nextval('tollgate_rule_change_seq'))::text);
    END IF;
    RETURN NULL;
END;
$$;
