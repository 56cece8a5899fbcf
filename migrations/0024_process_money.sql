-- Money shown right (issue 40): a definition declares which input fields are money
-- (`Definition::money`: whole minor units, and where the currency's code is), and the start
-- stores the declared amounts resolved against the input, so the console's cards, its process
-- page and the CLI show "63.96 EUR", never the minor units as if they were major ("6396 EUR").
--
-- A constant default and no CHECK: adding the column neither rewrites nor scans the table. Processes started before it, or of a
-- definition that declares no money, have '[]', and the console falls back to the product's
-- convention (`amount` in minor units with `currency`) and says it did.

ALTER TABLE {{schema}}.processes ADD COLUMN money jsonb NOT NULL DEFAULT '[]';
COMMENT ON COLUMN {{schema}}.processes.money IS 'The input amounts the definition declares money (Definition::money), resolved at start: [{field, minor, currency, shown}], shown is what a person reads ("63.96 EUR"). [] when it declares none.';
