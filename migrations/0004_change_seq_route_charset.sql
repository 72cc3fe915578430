-- 1. Every rule change event carries a sequence number. PostgreSQL delivers
--    identical payloads sent on one channel within one transaction only
--    once, so a transaction that set a rule to 10, then 20, then back to 10
--    (or deleted, re-created and deleted it) would announce only the first
--    two states and leave every gateway on the wrong one.
--    Every role that writes rules may draw from the sequence.
-- 2. Route ids follow the gateway's charset, which has no ':' (it separates
--    the sub-bucket index in sharded keys). Rows already stored are not
--    re-checked (NOT VALID): gateways skip such rules with a warning, and
--    such a share row matches no route. An UPDATE of such a row must fix
--    its route id, or the check refuses it.

CREATE SEQUENCE tollgate_rule_change_seq;
GRANT USAGE ON SEQUENCE tollgate_rule_change_seq TO PUBLIC;

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
            'shards', NEW.shards, 'exact', NEW.exact,
            'seq', nextval('tollgate_rule_change_seq'))::text);
    END IF;
    RETURN NULL;
END;
$$;

ALTER TABLE rate_limit_rule
    DROP CONSTRAINT rate_limit_rule_route_id_check,
    ADD CONSTRAINT rate_limit_rule_route_id_check
        CHECK (route_id ~ '^[A-Za-z0-9._-]{1,64}$') NOT VALID;

ALTER TABLE region_share
    DROP CONSTRAINT region_share_route_id_check,
    ADD CONSTRAINT region_share_route_id_check
        CHECK (route_id ~ '^[A-Za-z0-9._-]{1,64}$') NOT VALID;
