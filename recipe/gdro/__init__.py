from recipe.gdro.moved import refuse_old_name

refuse_old_name()
