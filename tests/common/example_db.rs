//! A database for one run of an example app: an SQLite file in a directory of its own, or a
//! PostgreSQL schema or MariaDB database of its own, named like the suite's others so that CI
//! drops it should the test die before [`ExampleDatabase::cleanup`].

use super::names::unique;

/// The backend an example runs on.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Db {
    Sqlite,
    #[cfg(feature = "postgres")]
    Postgres,
    #[cfg(feature = "mysql")]
    Mariadb,
}

pub(crate) struct ExampleDatabase {
    /// The example's `DATABASE_URL`.
    pub(crate) url: String,
    /// The admin URL and the statement that drops the schema or the database.
    drop: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

impl ExampleDatabase {
    pub(crate) async fn new(db: Db) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (url, drop) = match db {
            Db::Sqlite => (
                format!("sqlite://{}", dir.path().join("example.db").display()),
                None,
            ),
            #[cfg(feature = "postgres")]
            Db::Postgres => {
                let base = std::env::var("TEST_POSTGRES_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
                let schema = unique("orders");
                let admin = sqlx::PgPool::connect(&base)
                    .await
                    .unwrap_or_else(|e| panic!("PostgreSQL at {base} is unreachable: {e}"));
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                    .execute(&admin)
                    .await
                    .expect("schema");
                let url = format!("{base}?options=-c%20search_path%3D{schema}");
                (url, Some((base, format!("DROP SCHEMA {schema} CASCADE"))))
            }
            #[cfg(feature = "mysql")]
            Db::Mariadb => {
                let base = std::env::var("TEST_MYSQL_URL")
                    .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
                let database = unique("orders");
                let admin = sqlx::MySqlPool::connect(&base)
                    .await
                    .unwrap_or_else(|e| panic!("MariaDB/MySQL at {base} is unreachable: {e}"));
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
                    .execute(&admin)
                    .await
                    .expect("database");
                let server = base.rsplit_once('/').map_or(base.as_str(), |(s, _)| s);
                let url = format!("{server}/{database}");
                (url, Some((base, format!("DROP DATABASE {database}"))))
            }
        };
        Self {
            url,
            drop,
            _dir: dir,
        }
    }

    /// Drops the schema or the database (the SQLite file goes with the directory).
    pub(crate) async fn cleanup(self) {
        #[cfg(any(feature = "postgres", feature = "mysql"))]
        if let Some((admin, drop)) = self.drop {
            let drop = sqlx::AssertSqlSafe(drop);
            match admin.split(':').next() {
                #[cfg(feature = "postgres")]
                Some("postgres") => {
                    let admin = sqlx::PgPool::connect(&admin).await.expect("admin");
                    sqlx::raw_sql(drop).execute(&admin).await.expect("drop");
                }
                #[cfg(feature = "mysql")]
                Some("mysql") => {
                    let admin = sqlx::MySqlPool::connect(&admin).await.expect("admin");
                    sqlx::raw_sql(drop).execute(&admin).await.expect("drop");
                }
                _ => {}
            }
        }
    }
}
