//! The example's own tables, written once for every backend.
//!
//! `OrdersDb` is implemented for each sqlx database by one blanket impl; only the DDL and the
//! placeholder style differ per backend (see `Backend`).

use std::future::Future;

use serde::Serialize;
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Pool, Row, Type};

/// What differs between backends in this example.
pub(crate) trait Backend: Database + axum_idempotency::Backend {
    const SCHEMA: &'static str;
    /// Adds a like unless it exists; the unique key on (user, article) is the natural key.
    const ADD_LIKE: &'static str;
    /// MySQL numbers placeholders with `?`, the others accept `$1, $2, …` in order.
    const QUESTION_MARKS: bool = false;
    /// How many rows a statement changed (sqlx has no backend-neutral call for it).
    fn rows_affected(result: &Self::QueryResult) -> u64;
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Order {
    pub(crate) id: i64,
    pub(crate) status: String,
    pub(crate) sku: String,
    pub(crate) quantity: i64,
    pub(crate) amount: f64,
    pub(crate) currency: String,
    /// Payment events the consumer applied, in the order applied.
    pub(crate) payments: Vec<AppliedPayment>,
    pub(crate) paid_total: f64,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct AppliedPayment {
    pub(crate) payment_id: String,
    pub(crate) amount: f64,
}

pub(crate) struct NewOrder<'a> {
    pub(crate) user_id: i64,
    pub(crate) sku: &'a str,
    pub(crate) quantity: i64,
    pub(crate) amount: f64,
    pub(crate) currency: &'a str,
}

/// Why stock could not be taken.
pub(crate) enum StockError {
    UnknownSku,
    OutOfStock,
    Db(sqlx::Error),
}

impl From<sqlx::Error> for StockError {
    fn from(e: sqlx::Error) -> Self {
        Self::Db(e)
    }
}

fn sql<DB: Backend>(text: &'static str) -> sqlx::AssertSqlSafe<String> {
    if !DB::QUESTION_MARKS {
        return sqlx::AssertSqlSafe(text.to_owned());
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
            out.push('?');
        } else {
            out.push(c);
        }
    }
    sqlx::AssertSqlSafe(out)
}

fn order_from<R: Row>(row: &R) -> sqlx::Result<Order>
where
    usize: ColumnIndex<R>,
    i64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    String: for<'r> Decode<'r, R::Database> + Type<R::Database>,
    f64: for<'r> Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(Order {
        id: row.try_get(0)?,
        status: row.try_get(1)?,
        sku: row.try_get(2)?,
        quantity: row.try_get(3)?,
        amount: row.try_get(4)?,
        currency: row.try_get(5)?,
        payments: Vec::new(),
        paid_total: 0.0,
    })
}

type Conn<DB> = <DB as Database>::Connection;

pub(crate) trait OrdersDb: Backend {
    fn create_schema(pool: &Pool<Self>) -> impl Future<Output = sqlx::Result<()>> + Send;
    fn user_by_token(
        pool: &Pool<Self>,
        token: &str,
    ) -> impl Future<Output = sqlx::Result<Option<i64>>> + Send;
    fn take_stock<'a>(
        conn: &'a mut Conn<Self>,
        sku: &'a str,
        quantity: i64,
    ) -> impl Future<Output = Result<(), StockError>> + Send + 'a;
    fn insert_order<'a>(
        conn: &'a mut Conn<Self>,
        order: &'a NewOrder<'a>,
    ) -> impl Future<Output = sqlx::Result<Order>> + Send + 'a;
    fn orders_of(
        conn: &mut Conn<Self>,
        user_id: i64,
    ) -> impl Future<Output = sqlx::Result<Vec<Order>>> + Send + '_;
    fn order_of(
        conn: &mut Conn<Self>,
        user_id: i64,
        id: i64,
    ) -> impl Future<Output = sqlx::Result<Option<Order>>> + Send + '_;
    fn ship<'a>(
        conn: &'a mut Conn<Self>,
        user_id: i64,
        id: i64,
    ) -> impl Future<Output = sqlx::Result<bool>> + Send + 'a;
    fn set_like<'a>(
        conn: &'a mut Conn<Self>,
        user_id: i64,
        article_id: i64,
        liked: bool,
    ) -> impl Future<Output = sqlx::Result<i64>> + Send + 'a;
    /// Appends a payment to an order and marks it paid once covered; `false` when the order
    /// does not exist. Runs in the consumer's transaction, next to the inbox's claim.
    #[cfg_attr(not(feature = "inbox"), allow(dead_code))]
    fn apply_payment<'a>(
        conn: &'a mut Conn<Self>,
        order_id: i64,
        payment_id: &'a str,
        amount: f64,
    ) -> impl Future<Output = sqlx::Result<bool>> + Send + 'a;
}

impl<DB> OrdersDb for DB
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'c> &'c Pool<DB>: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    f64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
{
    async fn create_schema(pool: &Pool<Self>) -> sqlx::Result<()> {
        sqlx::raw_sql(DB::SCHEMA).execute(pool).await?;
        Ok(())
    }

    async fn user_by_token(pool: &Pool<Self>, token: &str) -> sqlx::Result<Option<i64>> {
        sqlx::query(sql::<DB>("SELECT id FROM users WHERE token = $1"))
            .bind(token.to_owned())
            .fetch_optional(pool)
            .await?
            .map(|row| row.try_get(0))
            .transpose()
    }

    async fn take_stock<'a>(
        conn: &'a mut Conn<Self>,
        sku: &'a str,
        quantity: i64,
    ) -> Result<(), StockError> {
        let taken = sqlx::query(sql::<DB>(
            "UPDATE products SET stock = stock - $1 WHERE sku = $2 AND stock >= $3",
        ))
        .bind(quantity)
        .bind(sku.to_owned())
        .bind(quantity)
        .execute(&mut *conn)
        .await?;
        if DB::rows_affected(&taken) == 1 {
            return Ok(());
        }
        let known = sqlx::query(sql::<DB>("SELECT sku FROM products WHERE sku = $1"))
            .bind(sku.to_owned())
            .fetch_optional(&mut *conn)
            .await?;
        Err(if known.is_some() {
            StockError::OutOfStock
        } else {
            StockError::UnknownSku
        })
    }

    async fn insert_order<'a>(
        conn: &'a mut Conn<Self>,
        order: &'a NewOrder<'a>,
    ) -> sqlx::Result<Order> {
        let row = sqlx::query(sql::<DB>(
            "INSERT INTO orders (user_id, status, sku, quantity, amount, currency) \
             VALUES ($1, 'created', $2, $3, $4, $5) \
             RETURNING id, status, sku, quantity, amount, currency",
        ))
        .bind(order.user_id)
        .bind(order.sku.to_owned())
        .bind(order.quantity)
        .bind(order.amount)
        .bind(order.currency.to_owned())
        .fetch_one(conn)
        .await?;
        order_from(&row)
    }

    async fn orders_of(conn: &mut Conn<Self>, user_id: i64) -> sqlx::Result<Vec<Order>> {
        let rows = sqlx::query(sql::<DB>(
            "SELECT id, status, sku, quantity, amount, currency FROM orders WHERE user_id = $1 ORDER BY id",
        ))
            .bind(user_id)
            .fetch_all(&mut *conn)
            .await?;
        let mut orders = rows
            .iter()
            .map(order_from)
            .collect::<sqlx::Result<Vec<_>>>()?;
        for order in &mut orders {
            with_payments::<DB>(conn, order).await?;
        }
        Ok(orders)
    }

    async fn order_of(conn: &mut Conn<Self>, user_id: i64, id: i64) -> sqlx::Result<Option<Order>> {
        let row = sqlx::query(sql::<DB>(
            "SELECT id, status, sku, quantity, amount, currency FROM orders WHERE user_id = $1 AND id = $2",
        ))
        .bind(user_id)
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(mut order) = row.as_ref().map(order_from).transpose()? else {
            return Ok(None);
        };
        with_payments::<DB>(conn, &mut order).await?;
        Ok(Some(order))
    }

    async fn ship(conn: &mut Conn<Self>, user_id: i64, id: i64) -> sqlx::Result<bool> {
        let done = sqlx::query(sql::<DB>(
            "UPDATE orders SET status = 'shipped' WHERE user_id = $1 AND id = $2",
        ))
        .bind(user_id)
        .bind(id)
        .execute(conn)
        .await?;
        Ok(DB::rows_affected(&done) == 1)
    }

    async fn set_like(
        conn: &mut Conn<Self>,
        user_id: i64,
        article_id: i64,
        liked: bool,
    ) -> sqlx::Result<i64> {
        let change = if liked {
            DB::ADD_LIKE
        } else {
            "DELETE FROM likes WHERE user_id = $1 AND article_id = $2"
        };
        sqlx::query(sql::<DB>(change))
            .bind(user_id)
            .bind(article_id)
            .execute(&mut *conn)
            .await?;
        sqlx::query(sql::<DB>(
            "SELECT COUNT(*) FROM likes WHERE article_id = $1",
        ))
        .bind(article_id)
        .fetch_one(conn)
        .await?
        .try_get(0)
    }

    async fn apply_payment(
        conn: &mut Conn<Self>,
        order_id: i64,
        payment_id: &str,
        amount: f64,
    ) -> sqlx::Result<bool> {
        let order = sqlx::query(sql::<DB>("SELECT id FROM orders WHERE id = $1"))
            .bind(order_id)
            .fetch_optional(&mut *conn)
            .await?;
        if order.is_none() {
            return Ok(false);
        }
        // No unique key on payment_id here on purpose: exactly-once comes from the inbox's
        // claim on the payment id, committed in this same transaction.
        sqlx::query(sql::<DB>(
            "INSERT INTO order_payments (order_id, payment_id, amount) VALUES ($1, $2, $3)",
        ))
        .bind(order_id)
        .bind(payment_id.to_owned())
        .bind(amount)
        .execute(&mut *conn)
        .await?;
        sqlx::query(sql::<DB>(
            "UPDATE orders SET status = 'paid' WHERE id = $1 AND status = 'created' \
             AND amount <= (SELECT COALESCE(SUM(amount), 0) FROM order_payments WHERE order_id = $2)",
        ))
        .bind(order_id)
        .bind(order_id)
        .execute(conn)
        .await?;
        Ok(true)
    }
}

/// Reads the payments applied to `order`.
async fn with_payments<DB>(conn: &mut Conn<DB>, order: &mut Order) -> sqlx::Result<()>
where
    DB: Backend,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    i64: for<'q> Encode<'q, DB> + Type<DB>,
    f64: for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
{
    let rows = sqlx::query(sql::<DB>(
        "SELECT payment_id, amount FROM order_payments WHERE order_id = $1 ORDER BY seq",
    ))
    .bind(order.id)
    .fetch_all(conn)
    .await?;
    for row in &rows {
        let payment = AppliedPayment {
            payment_id: row.try_get(0)?,
            amount: row.try_get(1)?,
        };
        order.paid_total += payment.amount;
        order.payments.push(payment);
    }
    Ok(())
}

#[cfg(feature = "sqlite")]
impl Backend for sqlx::Sqlite {
    const SCHEMA: &'static str = "
        CREATE TABLE IF NOT EXISTS users (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, token TEXT NOT NULL UNIQUE);
        CREATE TABLE IF NOT EXISTS products (sku TEXT PRIMARY KEY, stock INTEGER NOT NULL);
        CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY AUTOINCREMENT, user_id INTEGER NOT NULL,
            status TEXT NOT NULL, sku TEXT NOT NULL, quantity INTEGER NOT NULL, amount REAL NOT NULL, currency TEXT NOT NULL);
        CREATE TABLE IF NOT EXISTS likes (user_id INTEGER NOT NULL, article_id INTEGER NOT NULL, PRIMARY KEY (user_id, article_id));
        CREATE TABLE IF NOT EXISTS order_payments (seq INTEGER PRIMARY KEY AUTOINCREMENT, order_id INTEGER NOT NULL,
            payment_id TEXT NOT NULL, amount REAL NOT NULL);
        INSERT INTO users (id, name, token) VALUES (1, 'alice', 'alice-token'), (2, 'bob', 'bob-token') ON CONFLICT DO NOTHING;
        INSERT INTO products (sku, stock) VALUES ('widget', 1000000000), ('gadget', 1) ON CONFLICT DO NOTHING;";
    const ADD_LIKE: &'static str =
        "INSERT INTO likes (user_id, article_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
}

#[cfg(feature = "postgres")]
impl Backend for sqlx::Postgres {
    const SCHEMA: &'static str = "
        CREATE TABLE IF NOT EXISTS users (id BIGINT PRIMARY KEY, name TEXT NOT NULL UNIQUE, token TEXT NOT NULL UNIQUE);
        CREATE TABLE IF NOT EXISTS products (sku TEXT PRIMARY KEY, stock BIGINT NOT NULL);
        CREATE TABLE IF NOT EXISTS orders (id BIGSERIAL PRIMARY KEY, user_id BIGINT NOT NULL,
            status TEXT NOT NULL, sku TEXT NOT NULL, quantity BIGINT NOT NULL, amount DOUBLE PRECISION NOT NULL, currency TEXT NOT NULL);
        CREATE TABLE IF NOT EXISTS likes (user_id BIGINT NOT NULL, article_id BIGINT NOT NULL, PRIMARY KEY (user_id, article_id));
        CREATE TABLE IF NOT EXISTS order_payments (seq BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL,
            payment_id TEXT NOT NULL, amount DOUBLE PRECISION NOT NULL);
        INSERT INTO users (id, name, token) VALUES (1, 'alice', 'alice-token'), (2, 'bob', 'bob-token') ON CONFLICT DO NOTHING;
        INSERT INTO products (sku, stock) VALUES ('widget', 1000000000), ('gadget', 1) ON CONFLICT DO NOTHING;";
    const ADD_LIKE: &'static str =
        "INSERT INTO likes (user_id, article_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
}

// Tables keyed by text need a bounded VARCHAR in MySQL. INSERT … RETURNING (used for orders)
// is MariaDB's (10.5+): on MySQL 8 this example needs MariaDB.
#[cfg(feature = "mysql")]
impl Backend for sqlx::MySql {
    const SCHEMA: &'static str = "
        CREATE TABLE IF NOT EXISTS users (id BIGINT PRIMARY KEY, name VARCHAR(255) NOT NULL UNIQUE,
            token VARCHAR(255) NOT NULL UNIQUE) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS products (sku VARCHAR(64) PRIMARY KEY, stock BIGINT NOT NULL) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, user_id BIGINT NOT NULL,
            status VARCHAR(32) NOT NULL, sku VARCHAR(64) NOT NULL, quantity BIGINT NOT NULL,
            amount DOUBLE NOT NULL, currency VARCHAR(8) NOT NULL) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS likes (user_id BIGINT NOT NULL, article_id BIGINT NOT NULL,
            PRIMARY KEY (user_id, article_id)) ENGINE = InnoDB;
        CREATE TABLE IF NOT EXISTS order_payments (seq BIGINT AUTO_INCREMENT PRIMARY KEY, order_id BIGINT NOT NULL,
            payment_id VARCHAR(255) NOT NULL, amount DOUBLE NOT NULL) ENGINE = InnoDB;
        INSERT IGNORE INTO users (id, name, token) VALUES (1, 'alice', 'alice-token'), (2, 'bob', 'bob-token');
        INSERT IGNORE INTO products (sku, stock) VALUES ('widget', 1000000000), ('gadget', 1);";
    // A no-op update rather than INSERT IGNORE, which would also silence unrelated errors.
    const ADD_LIKE: &'static str = "INSERT INTO likes (user_id, article_id) VALUES ($1, $2) \
        ON DUPLICATE KEY UPDATE user_id = user_id";
    const QUESTION_MARKS: bool = true;

    fn rows_affected(result: &Self::QueryResult) -> u64 {
        result.rows_affected()
    }
}
