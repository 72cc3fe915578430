-- A mode per rule: 'enforce' (refusals answer 429) or 'shadow' (refusals
-- are forwarded anyway and counted as shadow_rejected, to try a new limit
-- out). Every existing rule keeps enforcing. Change events carry the mode;
-- a gateway that predates it ignores the field and enforces.

ALTER TABLE rate_limit_rule
    ADD COLUMN mode text NOT NULL DEFAULT 'enforce'
        CHECK (mode IN ('enforce', 'shadow'));

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
            'shards', NEW.shards, 'exact', NEW.exact, 'mode', NEW.mode, 'name', NEW.name,
            'seq', nextval('tollgate_rule_change_seq'))::text);
    END IF;
    RETURN NULL;
END;
$$;
