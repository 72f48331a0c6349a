//! What the connecting role may do, read from the catalogs with plain reads: the schema it can
//! use, the rights a use of the store needs on a migrated schema ([`Access`]), and the rights a
//! migration needs. Each missing right is named with its object, for the errors of `connect`.

use tokio_postgres::GenericClient;

use crate::PostgresError;

/// What a connection to the store is for, and so the rights its role needs on a migrated schema
/// (`USAGE` on the schema in every case). `docs/stores.md`, "PostgreSQL roles", gives the grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    /// A gateway or a service's layer: claims, answers, renewals, purges, the scope salt (made by
    /// the first caller), and `idem_claim_insert`.
    Serve,
    /// `idem list` and `idem inspect`: reads of records and of the scope salt.
    Read,
    /// `idem delete`: reads, and a record deleted or fenced.
    Delete,
    /// `idem purge`: expired records deleted or dropped to tombstones.
    Purge,
}

impl Access {
    /// The rights this use needs: (right, kind of object, object in the schema).
    fn needs(self) -> &'static [(&'static str, &'static str, &'static str)] {
        const RECORDS_READ: (&str, &str, &str) = ("SELECT", "table", "idem_records");
        const RECORDS_UPDATE: (&str, &str, &str) = ("UPDATE", "table", "idem_records");
        const RECORDS_DELETE: (&str, &str, &str) = ("DELETE", "table", "idem_records");
        const SALT_READ: (&str, &str, &str) = ("SELECT", "table", "idem_scope_salt");
        match self {
            Self::Serve => &[
                RECORDS_READ,
                ("INSERT", "table", "idem_records"),
                RECORDS_UPDATE,
                RECORDS_DELETE,
                SALT_READ,
                ("INSERT", "table", "idem_scope_salt"),
                ("UPDATE", "table", "idem_scope_salt"),
                (
                    "EXECUTE",
                    "function",
                    "idem_claim_insert(text,text,bytea,bytea,bytea,bigint,bigint,bigint,bigint,text,text,text)",
                ),
            ],
            Self::Read => &[RECORDS_READ, SALT_READ],
            Self::Delete => &[RECORDS_READ, RECORDS_UPDATE, RECORDS_DELETE, SALT_READ],
            Self::Purge => &[RECORDS_READ, RECORDS_UPDATE, RECORDS_DELETE],
        }
    }
}

/// Where the store's schema stands, as the connecting role sees it.
#[derive(Debug)]
pub(crate) struct Found {
    /// `current_user`.
    pub(crate) role: String,
    /// The schema of the store's tables (`schema=`, or the first usable one of the `search_path`).
    pub(crate) schema: String,
    /// Whether the schema exists.
    pub(crate) exists: bool,
    /// The newest version recorded in `idem_schema_migrations` (0: none, or no table).
    pub(crate) version: i32,
}

/// Reads the schema's version with plain reads: no DDL, no lock. The role must have `USAGE` on
/// the schema (if it exists) and `SELECT` on `idem_schema_migrations` (if it exists).
pub(crate) async fn read_version(
    client: &impl GenericClient,
    target: &str,
    schema: Option<&str>,
) -> Result<Found, PostgresError> {
    let failed = |err| failed(target, "reading the schema's version", err);
    let row = client
        .query_one(
            "SELECT current_user::text, COALESCE($1::text, current_schema()::text), n.oid IS NOT NULL,
                    n.oid IS NULL OR has_schema_privilege(n.oid, 'USAGE'),
                    m.oid IS NOT NULL, m.oid IS NULL OR has_table_privilege(m.oid, 'SELECT'),
                    current_setting('search_path')
             FROM (SELECT 1) AS one
             LEFT JOIN pg_catalog.pg_namespace n ON n.nspname = COALESCE($1::text, current_schema())
             LEFT JOIN pg_catalog.pg_class m ON m.relnamespace = n.oid AND m.relname = 'idem_schema_migrations'",
            &[&schema],
        )
        .await
        .map_err(failed)?;
    let role: String = row.get(0);
    let Some(name) = row.get::<_, Option<String>>(1) else {
        // No schema named, and none of the search_path is one the role may use.
        return Err(no_usable_schema(client, target, role, row.get(6)).await?);
    };
    let missing = |missing: String| PostgresError::MissingPrivileges {
        target: target.to_owned(),
        role: role.clone(),
        missing,
    };
    if !row.get::<_, bool>(3) {
        return Err(missing(format!("USAGE on schema {name}")));
    }
    if !row.get::<_, bool>(5) {
        return Err(missing(format!("SELECT on table {name}.idem_schema_migrations")));
    }
    let version = if row.get(4) {
        client
            .query_one(
                &format!("SELECT COALESCE(MAX(version), 0) FROM \"{name}\".idem_schema_migrations"),
                &[],
            )
            .await
            .map_err(failed)?
            .get(0)
    } else {
        0
    };
    Ok(Found {
        role,
        schema: name,
        exists: row.get(2),
        version,
    })
}

/// Why no schema of `search_path` is usable: one that exists without `USAGE` for the role, or none
/// that exists.
async fn no_usable_schema(
    client: &impl GenericClient,
    target: &str,
    role: String,
    search_path: String,
) -> Result<PostgresError, PostgresError> {
    let names: Vec<String> = search_path
        .split(',')
        .map(|name| name.trim().trim_matches('"'))
        .map(|name| if name == "$user" { role.clone() } else { name.to_owned() })
        .collect();
    let unusable: Option<String> = client
        .query_one(
            "SELECT string_agg(format('USAGE on schema %s', nspname), ', ' ORDER BY array_position($1::text[], nspname::text))
             FROM pg_catalog.pg_namespace
             WHERE nspname = ANY ($1::text[]) AND NOT has_schema_privilege(oid, 'USAGE')",
            &[&names],
        )
        .await
        .map_err(|err| failed(target, "reading the search_path's schemas", err))?
        .get(0);
    Ok(match unusable {
        Some(missing) => PostgresError::MissingPrivileges {
            target: target.to_owned(),
            role,
            missing,
        },
        None => PostgresError::NoSchema {
            target: target.to_owned(),
            search_path,
        },
    })
}

/// The rights a migration of `found` needs that the role lacks: `CREATE` on the database (to
/// create the schema) or on the schema, and the ownership of the store's tables and functions that
/// exist (a migration alters them). Empty: the role can migrate.
pub(crate) async fn missing_for_migration(
    client: &impl GenericClient,
    target: &str,
    found: &Found,
) -> Result<Vec<String>, PostgresError> {
    let rows = client
        .query(
            "SELECT format('CREATE on database %s (to create the schema %s)', current_database(), $1::text)
             WHERE NOT $2::bool AND NOT has_database_privilege(current_database(), 'CREATE')
             UNION ALL
             SELECT format('CREATE on schema %s', n.nspname)
             FROM pg_catalog.pg_namespace n WHERE n.nspname = $1 AND NOT has_schema_privilege(n.oid, 'CREATE')
             UNION ALL
             SELECT format('the ownership of table %s.%s (owned by %s)', n.nspname, c.relname, pg_get_userbyid(c.relowner))
             FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relkind = 'r'
               AND c.relname IN ('idem_records', 'idem_scope_salt', 'idem_schema_migrations')
               AND NOT pg_has_role(c.relowner, 'USAGE')
             UNION ALL
             SELECT format('the ownership of function %s.%s (owned by %s)', n.nspname, p.proname, pg_get_userbyid(p.proowner))
             FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = $1 AND p.proname LIKE 'idem\\_%' AND NOT pg_has_role(p.proowner, 'USAGE')",
            &[&found.schema, &found.exists],
        )
        .await
        .map_err(|err| failed(target, "reading the rights a migration needs", err))?;
    let mut missing: Vec<String> = rows.iter().map(|row| row.get(0)).collect();
    missing.dedup();
    Ok(missing)
}

/// Checks that the role has every right `access` needs on the migrated `schema`.
pub(crate) async fn check(
    client: &impl GenericClient,
    target: &str,
    schema: Option<&str>,
    access: Access,
) -> Result<(), PostgresError> {
    let found = read_version(client, target, schema).await?;
    let (mut rights, mut kinds, mut objects) = (Vec::new(), Vec::new(), Vec::new());
    for &(right, kind, object) in access.needs() {
        rights.push(right);
        kinds.push(kind);
        objects.push(format!("\"{}\".{object}", found.schema));
    }
    let missing: Option<String> = client
        .query_one(
            "SELECT string_agg(format('%s on %s %s', n.needed, n.kind, replace(n.object, '\"', '')), ', ' ORDER BY n.at)
             FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS n(needed, kind, object, at)
             WHERE NOT CASE
                 WHEN n.kind = 'table' AND to_regclass(n.object) IS NOT NULL THEN has_table_privilege(n.object, n.needed)
                 WHEN n.kind = 'function' AND to_regprocedure(n.object) IS NOT NULL
                     THEN has_function_privilege(n.object, n.needed)
                 ELSE false
             END",
            &[&rights, &kinds, &objects],
        )
        .await
        .map_err(|err| failed(target, "reading the role's rights", err))?
        .get(0);
    match missing {
        None => Ok(()),
        Some(missing) => Err(PostgresError::MissingPrivileges {
            target: target.to_owned(),
            role: found.role,
            missing,
        }),
    }
}

fn failed(target: &str, step: &str, err: tokio_postgres::Error) -> PostgresError {
    PostgresError::Migrate {
        target: target.to_owned(),
        step: step.to_owned(),
        source: Box::new(err),
    }
}
