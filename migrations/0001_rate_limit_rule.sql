-- Per-tenant rate-limit rules (SPEC §4.1) and their change events.
--
-- Every insert, update and delete issues NOTIFY on channel `tollgate_rules`
-- with a JSON payload, so a change made with plain SQL propagates to every
-- gateway exactly like one made through the admin API:
--   {"op":"upsert","tenant":…,"route":…,"capacity":…,"refill_per_second":…}
--   {"op":"delete","tenant":…,"route":…}
--   {"op":"reload"}   (TRUNCATE: gateways reload everything)

CREATE TABLE rate_limit_rule (
    id                bigserial   PRIMARY KEY,
    tenant_id         varchar(64) NOT NULL
                      CHECK (tenant_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    route_id          varchar(64) NOT NULL
                      CHECK (route_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    capacity          integer     NOT NULL CHECK (capacity > 0),
    refill_per_second integer     NOT NULL CHECK (refill_per_second > 0),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT rate_limit_rule_tenant_route UNIQUE (tenant_id, route_id)
);

CREATE FUNCTION tollgate_rule_touch() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

CREATE TRIGGER rate_limit_rule_touch
    BEFORE UPDATE ON rate_limit_rule
    FOR EACH ROW EXECUTE FUNCTION tollgate_rule_touch();

CREATE FUNCTION tollgate_rule_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE'
       OR (TG_OP = 'UPDATE' AND (OLD.tenant_id, OLD.route_id) IS DISTINCT FROM (NEW.tenant_id, NEW.route_id)) THEN
        PERFORM pg_notify('tollgate_rules', json_build_object(
            'op', 'delete', 'tenant', OLD.tenant_id, 'route', OLD.route_id)::text);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        PERFORM pg_notify('tollgate_rules', json_build_object(
            'op', 'upsert', 'tenant', NEW.tenant_id, 'route', NEW.route_id,
            'capacity', NEW.capacity, 'refill_per_second', NEW.refill_per_second)::text);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER rate_limit_rule_notify
    AFTER INSERT OR UPDATE OR DELETE ON rate_limit_rule
    FOR EACH ROW EXECUTE FUNCTION tollgate_rule_notify();

CREATE FUNCTION tollgate_rule_notify_reload() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('tollgate_rules', '{"op":"reload"}');
    RETURN NULL;
END;
$$;

CREATE TRIGGER rate_limit_rule_truncate
    AFTER TRUNCATE ON rate_limit_rule
    FOR EACH STATEMENT EXECUTE FUNCTION tollgate_rule_notify_reload();
