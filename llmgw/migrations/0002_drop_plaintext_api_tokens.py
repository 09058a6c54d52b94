"""Drop DRF's authtoken table: it held operator API tokens in plain text.

Those tokens stopped working when operator tokens moved to hashed knox
tokens (llmgw.OperatorToken); the table would otherwise keep live-looking
secrets in the database and every backup of it. Operators create new tokens
with `manage.py api_token create`.
"""

from django.db import migrations

DROP = "DROP TABLE IF EXISTS authtoken_token"


class Migration(migrations.Migration):
    dependencies = [("llmgw", "0001_operator_token")]

    operations = [migrations.RunSQL(DROP, reverse_sql=migrations.RunSQL.noop)]
