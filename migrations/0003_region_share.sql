-- Each region's share of a limit (SPEC §7.4). A row with tenant_id and/or
-- route_id NULL applies to every tenant and/or route; the most specific row
-- wins (tenant+route, tenant, route, global), and a region with no row uses
-- the default_share of its regions/<id>.toml. The rebalancer rewrites rows
-- from traffic; operators may set them through /admin/shares.
--
-- Any change issues NOTIFY tollgate_shares (once per statement); gateways
-- then reload every row, since the table stays small.

CREATE TABLE region_share (
    id          bigserial        PRIMARY KEY,
    region_id   varchar(64)      NOT NULL CHECK (region_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    tenant_id   varchar(64)      NULL     CHECK (tenant_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    route_id    varchar(64)      NULL     CHECK (route_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    share       double precision NOT NULL CHECK (share > 0 AND share <= 1),
    updated_at  timestamptz      NOT NULL DEFAULT now(),
    CONSTRAINT region_share_scope UNIQUE NULLS NOT DISTINCT (region_id, tenant_id, route_id)
);

CREATE FUNCTION tollgate_share_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('tollgate_shares', '{"op":"changed"}');
    RETURN NULL;
END;
$$;

CREATE TRIGGER region_share_notify
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON region_share
    FOR EACH STATEMENT EXECUTE FUNCTION tollgate_share_notify();
