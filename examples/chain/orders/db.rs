//! The example's tables, and how each backend runs its SQL.
//!
//! Every statement is written once, with `?` for its arguments in order, and run on each
//! database through [`Backend`]; only the schema and one insert differ per backend.

use serde::Serialize;
use sqlx::{Database, Encode, Pool, QueryBuilder, Result, Type};

use crate::common::Cents;

/// An order as `GET /orders/{id}` shows it.
#[derive(Serialize)]
pub(crate) struct Order {
    id: i64,
    status: String,
    sku: String,
    quantity: i64,
    amount: Cents,
    currency: String,
    /// Payment events the consumer applied, in the order applied.
    payments: Vec<Payment>,
    paid_total: Cents,
}

#[derive(Serialize)]
struct Payment {
    payment_id: String,
    amount: Cents,
}

/// An order joined with one of its payments (or with `NULL`s), as [`orders`] selects it.
type OrderRow = (
    i64,
    String,
    String,
    i64,
    i64,
    String,
    i64,
    Option<String>,
    Option<i64>,
);

/// The user's orders with ids in `first..=last`, by id, each with its payments.
pub(crate) async fn orders<DB: Backend>(
    c: &mut DB::Connection,
    user_id: i64,
    (first, last): (i64, i64),
) -> Result<Vec<Order>> {
    let sql = "SELECT o.id, o.status, o.sku, o.quantity, o.amount, o.currency, o.paid_total, \
        p.payment_id, p.amount FROM orders o LEFT JOIN order_payments p ON p.order_id = o.id \
        WHERE o.user_id = ? AND o.id BETWEEN ? AND ? ORDER BY o.id, p.seq";
    let args = [Arg::Int(user_id), Arg::Int(first), Arg::Int(last)];
    let mut orders: Vec<Order> = Vec::new();
    for (id, status, sku, quantity, amount, currency, paid, payment_id, paid_amount) in
        DB::rows(c, sql, &args).await?
    {
        if orders.last().is_none_or(|order| order.id != id) {
            orders.push(Order {
                id,
                status,
                sku,
                quantity,
                amount: Cents(amount),
                currency,
                payments: Vec::new(),
                paid_total: Cents(paid),
            });
        }
        // The `LEFT JOIN` row of an order no payment has reached carries `NULL`s.
        if let (Some(order), Some(payment_id), Some(amount)) =
            (orders.last_mut(), payment_id, paid_amount)
        {
            let amount = Cents(amount);
            order.payments.push(Payment { payment_id, amount });
        }
    }
    Ok(orders)
}

/// An argument of a statement.
#[derive(Clone, Copy)]
pub(crate) enum Arg<'a> {
    Int(i64),
    Text(&'a str),
}

/// A statement's text: a constant, so arguments are only ever bound.
pub(crate) type Sql = &'static str;

/// A database the example runs on: one of the crate's backends, running the example's SQL.
pub(crate) trait Backend: axum_idempotency::Backend {
    /// Adds the like (user_id, article_id) unless it exists.
    const ADD_LIKE: Sql;

    /// Creates the example's tables and seed rows, unless they exist.
    fn create_tables(pool: &Pool<Self>) -> impl Run<()>;

    /// Runs a statement; answers how many rows it matched.
    fn execute(c: &mut Self::Connection, sql: Sql, args: &[Arg]) -> impl Run<u64>;

    /// The first column of the first row, if there is a row.
    fn int(c: &mut Self::Connection, sql: Sql, args: &[Arg]) -> impl Run<Option<i64>>;

    /// Every row, as [`orders`] selects them.
    fn rows(c: &mut Self::Connection, sql: Sql, args: &[Arg]) -> impl Run<Vec<OrderRow>>;
}

/// A statement running; `Send`, so the handlers generic over [`Backend`] are too.
pub(crate) trait Run<T>: Future<Output = Result<T>> + Send {}

impl<T, F: Future<Output = Result<T>> + Send> Run<T> for F {}

/// `sql` with each `?` bound to the next of `args`, in the placeholder syntax of `DB` (`$1`,
/// `$2`, … on PostgreSQL). The statements here hold no `?` of their own, in a literal say.
fn bind<'a, DB: Database>(sql: Sql, args: &[Arg<'a>]) -> QueryBuilder<DB>
where
    i64: Encode<'a, DB> + Type<DB>,
    &'a str: Encode<'a, DB> + Type<DB>,
{
    let mut parts = sql.split('?');
    let mut query = QueryBuilder::new(parts.next().unwrap_or_default());
    for (arg, part) in args.iter().zip(parts) {
        match *arg {
            Arg::Int(value) => query.push_bind(value),
            Arg::Text(value) => query.push_bind(value),
        };
        query.push(part);
    }
    query
}

/// Implements [`Backend`] for the database `$db` with its `$schema` and `$add_like`.
///
/// sqlx implements its traits for each database's own types, so one generic implementation
/// would need higher-ranked bounds; each expansion names concrete types instead.
macro_rules! backend {
    ($db:ty, $schema:expr, $add_like:expr) => {
        impl Backend for $db {
            const ADD_LIKE: Sql = $add_like;

            async fn create_tables(pool: &Pool<Self>) -> Result<()> {
                sqlx::raw_sql($schema).execute(pool).await.map(drop)
            }

            async fn execute(c: &mut Self::Connection, sql: Sql, args: &[Arg<'_>]) -> Result<u64> {
                Ok(bind(sql, args).build().execute(c).await?.rows_affected())
            }

            async fn int(
                c: &mut Self::Connection,
                sql: Sql,
                args: &[Arg<'_>],
            ) -> Result<Option<i64>> {
                bind(sql, args).build_query_scalar().fetch_optional(c).await
            }

            async fn rows(
                c: &mut Self::Connection,
                sql: Sql,
                args: &[Arg<'_>],
            ) -> Result<Vec<OrderRow>> {
                bind(sql, args).build_query_as().fetch_all(c).await
            }
        }
    };
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
const ADD_LIKE: Sql =
    "INSERT INTO likes (user_id, article_id) VALUES (?, ?) ON CONFLICT DO NOTHING";

#[cfg(feature = "sqlite")]
backend!(sqlx::Sqlite, SQLITE_SCHEMA, ADD_LIKE);
#[cfg(feature = "postgres")]
backend!(sqlx::Postgres, POSTGRES_SCHEMA, ADD_LIKE);
#[cfg(feature = "mysql")]
backend!(sqlx::MySql, MYSQL_SCHEMA, MYSQL_ADD_LIKE);

#[cfg(feature = "sqlite")]
const SQLITE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS users (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
    token TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS products (sku TEXT PRIMARY KEY, stock INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY AUTOINCREMENT, user_id INTEGER NOT NULL,
    status TEXT NOT NULL, sku TEXT NOT NULL, quantity INTEGER NOT NULL, amount INTEGER NOT NULL,
    currency TEXT NOT NULL, paid_total INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS likes (user_id INTEGER NOT NULL, article_id INTEGER NOT NULL,
    PRIMARY KEY (user_id, article_id));
CREATE TABLE IF NOT EXISTS order_payments (seq INTEGER PRIMARY KEY AUTOINCREMENT,
    order_id INTEGER NOT NULL, payment_id TEXT NOT NULL, amount INTEGER NOT NULL);
INSERT INTO users (id, name, token) VALUES (1, 'alice', 'alice-token'), (2, 'bob', 'bob-token')
    ON CONFLICT DO NOTHING;
INSERT INTO products (sku, stock) VALUES ('widget', 1000000000), ('gadget', 1)
    ON CONFLICT DO NOTHING;";

#[cfg(feature = "postgres")]
const POSTGRES_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS users (id BIGINT PRIMARY KEY, name TEXT NOT NULL UNIQUE,
    token TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS products (sku TEXT PRIMARY KEY, stock BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS orders (id BIGSERIAL PRIMARY KEY, user_id BIGINT NOT NULL,
    status TEXT NOT NULL, sku TEXT NOT NULL, quantity BIGINT NOT NULL, amount BIGINT NOT NULL,
    currency TEXT NOT NULL, paid_total BIGINT NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS likes (user_id BIGINT NOT NULL, article_id BIGINT NOT NULL,
    PRIMARY KEY (user_id, article_id));
CREATE TABLE IF NOT EXISTS order_payments (seq BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL,
    payment_id TEXT NOT NULL, amount BIGINT NOT NULL);
INSERT INTO users (id, name, token) VALUES (1, 'alice', 'alice-token'), (2, 'bob', 'bob-token')
    ON CONFLICT DO NOTHING;
INSERT INTO products (sku, stock) VALUES ('widget', 1000000000), ('gadget', 1)
    ON CONFLICT DO NOTHING;";

/// utf8mb4, so any text the app accepts fits. Tokens are VARBINARY: the default collation
/// would take `ALICE-TOKEN` for alice's. INSERT … RETURNING is MariaDB's (10.5+): on MySQL 8
/// this example needs MariaDB.
#[cfg(feature = "mysql")]
const MYSQL_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS users (id BIGINT PRIMARY KEY, name VARCHAR(255) NOT NULL UNIQUE,
    token VARBINARY(255) NOT NULL UNIQUE) DEFAULT CHARSET = utf8mb4;
CREATE TABLE IF NOT EXISTS products (sku VARCHAR(64) PRIMARY KEY, stock BIGINT NOT NULL)
    DEFAULT CHARSET = utf8mb4;
CREATE TABLE IF NOT EXISTS orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, user_id BIGINT NOT NULL,
    status VARCHAR(16) NOT NULL, sku VARCHAR(64) NOT NULL, quantity BIGINT NOT NULL,
    amount BIGINT NOT NULL, currency VARCHAR(8) NOT NULL, paid_total BIGINT NOT NULL DEFAULT 0)
    DEFAULT CHARSET = utf8mb4;
CREATE TABLE IF NOT EXISTS likes (user_id BIGINT NOT NULL, article_id BIGINT NOT NULL,
    PRIMARY KEY (user_id, article_id));
CREATE TABLE IF NOT EXISTS order_payments (seq BIGINT AUTO_INCREMENT PRIMARY KEY,
    order_id BIGINT NOT NULL, payment_id VARCHAR(255) NOT NULL, amount BIGINT NOT NULL)
    DEFAULT CHARSET = utf8mb4;
INSERT IGNORE INTO users (id, name, token) VALUES (1, 'alice', 'alice-token'), (2, 'bob', 'bob-token');
INSERT IGNORE INTO products (sku, stock) VALUES ('widget', 1000000000), ('gadget', 1);";

/// A no-op update rather than INSERT IGNORE, which would also silence unrelated errors.
#[cfg(feature = "mysql")]
const MYSQL_ADD_LIKE: Sql = "INSERT INTO likes (user_id, article_id) VALUES (?, ?) \
    ON DUPLICATE KEY UPDATE user_id = user_id";
